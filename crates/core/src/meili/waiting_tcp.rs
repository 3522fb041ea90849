//! A TCP transport for ureq that waits through its caller: a backend's search waits for its socket
//! on the backend's latch, on the backend's own thread, so that a cancel or `statement_timeout`
//! ends the wait at once without a helper thread or a polling loop. The socket is nonblocking;
//! the connect, every read and every write that would block call [`SocketWait::wait`].

use std::fmt;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsRawFd, RawFd};
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use socket2::{Domain, Protocol, SockAddr, Socket, Type};
use ureq::unversioned::transport::{
    Buffers, ConnectionDetails, Connector, Either, LazyBuffers, NextTimeout, ShutdownHandle,
    Transport,
};
use ureq::{Error, Timeout};

/// Linux's errno of a nonblocking connect under way (`io::ErrorKind::InProgress` is unstable).
const EINPROGRESS: i32 = 115;

/// What a wait is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Interest {
    Read,
    Write,
}

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waited {
    /// The socket may be ready (a spurious wake is fine: the I/O is tried, then waited again).
    Ready,
    TimedOut,
    /// The caller is asked to stop (a backend's cancel or timeout): the request ends with an I/O
    /// error of kind `Interrupted`, and the caller raises its own error once the client returned.
    Interrupted,
}

/// How the thread that makes a request waits for its socket. A wait may also end the request by
/// unwinding: a backend raises a cancel's ERROR from inside it, and the connection is dropped.
pub trait SocketWait: Send + Sync + 'static {
    /// Waits until `fd` may be ready for `interest`, at most `timeout` (`None`: no limit).
    fn wait(&self, fd: RawFd, interest: Interest, timeout: Option<Duration>) -> Waited;

    /// `fd` is about to be closed: a wait that kept it registered (say in an epoll set) lets it
    /// go, since the number may next name another socket.
    fn forget(&self, _fd: RawFd) {}
}

/// Tells the wait that a socket is closed when it goes: on every path out of a connect, and when
/// a connection is dropped.
struct ForgetOnDrop<'a> {
    wait: &'a dyn SocketWait,
    fd: RawFd,
}

impl Drop for ForgetOnDrop<'_> {
    fn drop(&mut self) {
        self.wait.forget(self.fd);
    }
}

/// Opens nonblocking TCP connections whose waits go through a [`SocketWait`].
pub struct WaitingTcpConnector {
    wait: Arc<dyn SocketWait>,
}

impl WaitingTcpConnector {
    pub fn new(wait: Arc<dyn SocketWait>) -> WaitingTcpConnector {
        WaitingTcpConnector { wait }
    }

    fn connect_to(
        &self,
        address: SocketAddr,
        deadline: Option<Instant>,
    ) -> Result<TcpStream, Error> {
        let socket = Socket::new(
            Domain::for_address(address),
            Type::STREAM,
            Some(Protocol::TCP),
        )?;
        socket.set_nonblocking(true)?;
        // Declared after the socket, so dropped before it (closed on an error): the connection,
        // if made, is waited for afresh.
        let _forget = ForgetOnDrop {
            wait: &*self.wait,
            fd: socket.as_raw_fd(),
        };
        match socket.connect(&SockAddr::from(address)) {
            Ok(()) => {}
            Err(error)
                if error.kind() == io::ErrorKind::WouldBlock
                    || error.raw_os_error() == Some(EINPROGRESS) =>
            {
                // Writable once connected or failed; the pending error (if any) tells which.
                loop {
                    wait_until(
                        &*self.wait,
                        socket.as_raw_fd(),
                        Interest::Write,
                        deadline,
                        Timeout::Connect,
                    )?;
                    if let Some(error) = socket.take_error()? {
                        return Err(error.into());
                    }
                    match socket.peer_addr() {
                        Ok(_) => break,
                        Err(error) if error.kind() == io::ErrorKind::NotConnected => continue,
                        Err(error) => return Err(error.into()),
                    }
                }
            }
            Err(error) => return Err(error.into()),
        }
        Ok(socket.into())
    }
}

impl<In: Transport> Connector<In> for WaitingTcpConnector {
    type Out = Either<In, WaitingTcpTransport>;

    fn connect(
        &self,
        details: &ConnectionDetails,
        chained: Option<In>,
    ) -> Result<Option<Self::Out>, Error> {
        if chained.is_some() {
            // A proxy's connector made the connection already.
            return Ok(chained.map(Either::A));
        }
        let deadline = deadline_of(details.timeout)?;
        let mut last_error = None;
        for address in details.addrs.iter() {
            match self.connect_to(*address, deadline) {
                Ok(stream) => {
                    stream.set_nodelay(details.config.no_delay())?;
                    let stream = Arc::new(stream);
                    (details.register_shutdown)(
                        Arc::downgrade(&stream) as Weak<dyn ShutdownHandle>
                    )?;
                    let buffers = LazyBuffers::new(
                        details.config.input_buffer_size(),
                        details.config.output_buffer_size(),
                    );
                    return Ok(Some(Either::B(WaitingTcpTransport {
                        stream,
                        buffers,
                        wait: Arc::clone(&self.wait),
                        unsent: Vec::new(),
                        send_timeout: None,
                    })));
                }
                Err(error @ Error::Timeout(_)) => return Err(error),
                Err(error) => last_error = Some(error),
            }
        }
        Err(last_error.unwrap_or_else(|| {
            Error::Io(io::Error::new(
                io::ErrorKind::ConnectionRefused,
                "no address to connect to",
            ))
        }))
    }
}

impl fmt::Debug for WaitingTcpConnector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaitingTcpConnector").finish()
    }
}

/// A connection made by [`WaitingTcpConnector`].
pub struct WaitingTcpTransport {
    /// Shared (weakly) with the agent, which shuts it down on `Agent::shutdown`.
    stream: Arc<TcpStream>,
    buffers: LazyBuffers,
    wait: Arc<dyn SocketWait>,
    /// Output ureq handed over and not sent yet, and the timeout it came with.
    unsent: Vec<u8>,
    send_timeout: Option<NextTimeout>,
}

/// Output is sent at once past this size (a large request body), without waiting for the answer.
const FLUSH_AT: usize = 64 << 10;

impl WaitingTcpTransport {
    fn flush(&mut self) -> Result<(), Error> {
        let Some(timeout) = self.send_timeout.take() else {
            return Ok(());
        };
        let deadline = deadline_of(timeout)?;
        let mut sent = 0;
        while sent < self.unsent.len() {
            match (&*self.stream).write(&self.unsent[sent..]) {
                Ok(0) => return Err(io::Error::from(io::ErrorKind::WriteZero).into()),
                Ok(written) => sent += written,
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => wait_until(
                    &*self.wait,
                    self.stream.as_raw_fd(),
                    Interest::Write,
                    deadline,
                    timeout.reason,
                )?,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
        self.unsent.clear();
        Ok(())
    }
}

impl Transport for WaitingTcpTransport {
    fn buffers(&mut self) -> &mut dyn Buffers {
        &mut self.buffers
    }

    /// Keeps the output until ureq waits for an answer, then sends it in one write: a request's
    /// head and body arrive together, so the server reads the request at once.
    fn transmit_output(&mut self, amount: usize, timeout: NextTimeout) -> Result<(), Error> {
        self.unsent
            .extend_from_slice(&self.buffers.output()[..amount]);
        self.send_timeout = Some(timeout.for_write());
        if self.unsent.len() >= FLUSH_AT {
            self.flush()?;
        }
        Ok(())
    }

    fn await_input(&mut self, timeout: NextTimeout) -> Result<bool, Error> {
        let sent_request = self.send_timeout.is_some();
        self.flush()?;
        let timeout = timeout.for_read();
        let deadline = deadline_of(timeout)?;
        if sent_request {
            // An answer is never there the moment its request went out: wait before the first
            // read rather than learn that from a read.
            wait_until(
                &*self.wait,
                self.stream.as_raw_fd(),
                Interest::Read,
                deadline,
                timeout.reason,
            )?;
        }
        loop {
            let input = self.buffers.input_append_buf();
            match (&*self.stream).read(input) {
                Ok(amount) => {
                    self.buffers.input_appended(amount);
                    return Ok(amount > 0);
                }
                Err(error) if error.kind() == io::ErrorKind::WouldBlock => wait_until(
                    &*self.wait,
                    self.stream.as_raw_fd(),
                    Interest::Read,
                    deadline,
                    timeout.reason,
                )?,
                Err(error) if error.kind() == io::ErrorKind::Interrupted => {}
                Err(error) => return Err(error.into()),
            }
        }
    }

    /// A kept connection is good while nothing is waiting on it: bytes or an EOF from the server
    /// mean it is not (the socket is nonblocking).
    fn is_open(&mut self) -> bool {
        let mut byte = [0u8];
        matches!((&*self.stream).read(&mut byte), Err(error) if error.kind() == io::ErrorKind::WouldBlock)
    }
}

impl Drop for WaitingTcpTransport {
    fn drop(&mut self) {
        // Runs before the fields drop, so before the socket closes (the agent holds it only
        // weakly, to shut it down).
        self.wait.forget(self.stream.as_raw_fd());
    }
}

impl fmt::Debug for WaitingTcpTransport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WaitingTcpTransport")
            .field("peer", &self.stream.peer_addr().ok())
            .finish()
    }
}

/// The instant a timeout ends (`None`: never); a spent timeout is an error at once.
fn deadline_of(timeout: NextTimeout) -> Result<Option<Instant>, Error> {
    if timeout.after.is_not_happening() {
        return Ok(None);
    }
    if timeout.after.is_zero() {
        return Err(Error::Timeout(timeout.reason));
    }
    Ok(Instant::now().checked_add(*timeout.after))
}

fn wait_until(
    wait: &dyn SocketWait,
    fd: RawFd,
    interest: Interest,
    deadline: Option<Instant>,
    reason: Timeout,
) -> Result<(), Error> {
    let left = match deadline {
        None => None,
        Some(deadline) => {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(Error::Timeout(reason));
            }
            Some(left)
        }
    };
    match wait.wait(fd, interest, left) {
        Waited::Ready => Ok(()),
        Waited::TimedOut => Err(Error::Timeout(reason)),
        Waited::Interrupted => Err(Error::Io(std::io::Error::new(
            std::io::ErrorKind::Interrupted,
            "the request was interrupted by its caller",
        ))),
    }
}

#[cfg(test)]
mod tests {
    use std::net::TcpListener;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

    use serde_json::json;

    use super::*;
    use crate::meili::client::{Client, MeiliError};

    /// Waits by sleeping a millisecond (the transport tries again); counts its waits, and
    /// unwinds, as a backend's cancel does, while `cancel` is set.
    #[derive(Default)]
    struct TestWait {
        waits: AtomicUsize,
        cancel: AtomicBool,
    }

    impl SocketWait for TestWait {
        fn wait(&self, _fd: RawFd, _interest: Interest, timeout: Option<Duration>) -> Waited {
            self.waits.fetch_add(1, Ordering::Relaxed);
            if self.cancel.load(Ordering::Relaxed) {
                panic!("canceling statement due to user request");
            }
            let nap = Duration::from_millis(1);
            std::thread::sleep(timeout.map_or(nap, |left| left.min(nap)));
            Waited::Ready
        }
    }

    fn index_with_a_book(client: &Client) {
        let uid = client.create_index("books", "id").expect("enqueued");
        client
            .wait_task(uid, Duration::from_secs(10))
            .expect("created");
    }

    #[test]
    fn searches_wait_through_the_callers_wait() {
        let server = meili_test_server::TestServer::start(None).expect("test server");
        let wait = Arc::new(TestWait::default());
        let client =
            Client::with_socket_wait(&server.url(), None, Duration::from_secs(10), wait.clone())
                .expect("client");
        index_with_a_book(&client);
        for _ in 0..3 {
            let answer = client.search("books", &json!({"q": ""})).expect("answer");
            assert_eq!(answer["hits"], json!([]));
        }
        assert!(
            wait.waits.load(Ordering::Relaxed) > 0,
            "the answers were waited for"
        );
    }

    /// A server that holds its first connection without answering, and answers the request on
    /// the second (which must come in one piece) with an empty search result.
    fn first_connection_silent() -> (String, std::thread::JoinHandle<usize>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", listener.local_addr().expect("address"));
        let server = std::thread::spawn(move || {
            let mut held = Vec::new();
            let mut answered = 0;
            for (n, stream) in listener.incoming().take(2).enumerate() {
                let mut stream = stream.expect("accept");
                let mut request = [0u8; 4096];
                let read = stream.read(&mut request).unwrap_or(0);
                if n == 0 {
                    held.push(stream);
                    continue;
                }
                // One write: the head and the body come in the first read.
                assert!(
                    request[..read].ends_with(b"\r\n\r\n{}"),
                    "{:?}",
                    String::from_utf8_lossy(&request[..read])
                );
                let body = r#"{"hits":[],"query":"","processingTimeMs":0}"#;
                let _ = write!(
                    stream,
                    "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
                answered += 1;
            }
            answered
        });
        (url, server)
    }

    #[test]
    fn a_wait_that_unwinds_ends_the_request_and_the_next_one_gets_a_fresh_connection() {
        let (url, server) = first_connection_silent();
        let wait = Arc::new(TestWait::default());
        let client = Client::with_socket_wait(&url, None, Duration::from_secs(30), wait.clone())
            .expect("client");
        wait.cancel.store(true, Ordering::Relaxed);
        let started = Instant::now();
        let canceled = catch_unwind(AssertUnwindSafe(|| client.search("books", &json!({}))));
        assert!(canceled.is_err(), "the cancel unwound out of the request");
        assert!(started.elapsed() < Duration::from_secs(5));
        wait.cancel.store(false, Ordering::Relaxed);
        let answer = client.search("books", &json!({})).expect("answer");
        assert_eq!(answer["hits"], json!([]));
        assert_eq!(server.join().expect("server"), 1);
    }

    #[test]
    fn a_silent_server_times_out_within_the_clients_timeout() {
        let silent = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", silent.local_addr().expect("address"));
        let client = Client::with_socket_wait(
            &url,
            None,
            Duration::from_millis(300),
            Arc::new(TestWait::default()),
        )
        .expect("client");
        let started = Instant::now();
        let error = client.search("books", &json!({})).expect_err("no answer");
        assert!(matches!(error, MeiliError::Transport(_)), "{error}");
        assert!(error.to_string().contains("imeout"), "{error}");
        let took = started.elapsed();
        assert!(
            took >= Duration::from_millis(250) && took < Duration::from_secs(5),
            "{took:?}"
        );
        drop(silent);
    }

    #[test]
    fn a_refused_connection_is_an_error_not_a_wait() {
        let closed = TcpListener::bind("127.0.0.1:0").expect("bind");
        let url = format!("http://{}", closed.local_addr().expect("address"));
        drop(closed);
        let client = Client::with_socket_wait(
            &url,
            None,
            Duration::from_secs(5),
            Arc::new(TestWait::default()),
        )
        .expect("client");
        let started = Instant::now();
        let error = client.search("books", &json!({})).expect_err("refused");
        assert!(matches!(error, MeiliError::Transport(_)), "{error}");
        assert!(started.elapsed() < Duration::from_secs(2));
    }
}
