//! Reads the text of a function's body (SQL or PL/pgSQL) for what a view task must know about it:
//! whether it names the role asking (`CURRENT_USER` and its kin) or runs SQL built at run time
//! (`EXECUTE`), and which functions, operators and other names it mentions, for the catalog to
//! follow. A token reader, not a parser: it errs towards seeing more code than PostgreSQL would,
//! never less, and says so when a body could read two ways.

/// A name the body calls as a function: `schema.name(` or `name(`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CalledName {
    pub schema: Option<String>,
    pub name: String,
}

/// What a function's body says.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BodyFacts {
    /// The keyword that reads the role or a setting, as written upper-case (`CURRENT_USER`,
    /// `SHOW`), if the body has one.
    pub reads_the_reader: Option<String>,
    /// Why the body cannot be followed, if it cannot: SQL built at run time, or text that reads
    /// two ways.
    pub cannot_follow: Option<String>,
    /// The names called as functions.
    pub calls: Vec<CalledName>,
    /// The operators written, symbols (`+`) or `OPERATOR(schema.+)`'s symbol.
    pub operators: Vec<String>,
    /// Every other name (relations, types, columns, and functions called in attribute notation,
    /// `row.f`), folded as PostgreSQL folds them.
    pub names: Vec<String>,
    /// Whether it may write to a table (`INSERT`, `UPDATE`, `DELETE`, `MERGE`): the triggers
    /// and column defaults of the tables it names then run too.
    pub writes: bool,
}

/// The operators PostgreSQL applies without their symbol being written: `IN`, `ANY`, `BETWEEN`,
/// `CASE x WHEN`, `NULLIF`, `IS DISTINCT FROM` and `USING` compare with `=`, `<>`, `<`, `>`,
/// `<=`, `>=`, and `LIKE`, `ILIKE` and `SIMILAR TO` match with `~~`, `~~*` and `~` (and their
/// negations). Every body is taken to use them all.
pub const IMPLIED_OPERATORS: [&str; 12] = [
    "=", "<>", "<", ">", "<=", ">=", "~~", "!~~", "~~*", "!~~*", "~", "!~",
];

/// Statements that write to a table.
const WRITE_KEYWORDS: [&str; 4] = ["insert", "update", "delete", "merge"];

/// Keywords that are the role asking (or its session's schema), wherever they stand as a value.
const ROLE_KEYWORDS: [&str; 6] = [
    "current_user",
    "session_user",
    "current_role",
    "user",
    "system_user",
    "current_schema",
];

/// PostgreSQL keeps this many bytes of a name (NAMEDATALEN - 1) and drops the rest.
const NAME_BYTES: usize = 63;

/// Characters of an operator symbol (PostgreSQL's lexer's `op_chars`).
const OPERATOR_CHARS: &str = "~!@#^&|`?+-*/%<>=";

#[derive(Debug, Clone, PartialEq)]
enum Token {
    /// An unquoted name, folded to lower case.
    Word(String),
    /// A double-quoted name, as written.
    Quoted(String),
    Operator(String),
    Punct(char),
    /// A literal, a number or a `$n` parameter: nothing to follow.
    Value,
}

/// Why a body's tokens cannot be read one way only; its text goes into `cannot_follow`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Unreadable {
    UnicodeEscapedName,
    UnendedComment,
    TwoWayString,
    UnendedString,
    StrayDollar,
    UnendedDollarString,
    UnendedQuotedName,
}

impl std::fmt::Display for Unreadable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Unreadable::UnicodeEscapedName => "it has a name written with Unicode escapes (U&\"…\")",
            Unreadable::UnendedComment => "its body has a comment that never ends",
            Unreadable::TwoWayString => "it has a string literal that reads two ways (a backslash before a quote, which standard_conforming_strings decides)",
            Unreadable::UnendedString => "its body has a string literal that never ends",
            Unreadable::StrayDollar => "it has a '$' that starts neither a parameter nor a quoted string",
            Unreadable::UnendedDollarString => "its body has a dollar-quoted string that never ends",
            Unreadable::UnendedQuotedName => "its body has a quoted name that never ends",
        })
    }
}

/// Reads `body` (the `prosrc` of an SQL or PL/pgSQL function).
pub fn read_body(body: &str) -> BodyFacts {
    let mut facts = BodyFacts::default();
    let tokens = match tokens(body) {
        Ok(tokens) => tokens,
        Err(why) => {
            facts.cannot_follow = Some(why.to_string());
            return facts;
        }
    };
    for (at, token) in tokens.iter().enumerate() {
        let before = at.checked_sub(1).map(|i| &tokens[i]);
        let after = tokens.get(at + 1);
        let (name, quoted) = match token {
            Token::Word(word) => (word, false),
            Token::Quoted(name) => (name, true),
            Token::Operator(symbol) => {
                facts.operators.push(symbol.clone());
                continue;
            }
            _ => continue,
        };
        let qualified = before == Some(&Token::Punct('.'));
        if !quoted && !qualified {
            if facts.reads_the_reader.is_none() && ROLE_KEYWORDS.contains(&name.as_str()) {
                facts.reads_the_reader = Some(name.to_uppercase());
            }
            if facts.reads_the_reader.is_none() && name == "show" {
                facts.reads_the_reader = Some("SHOW".into());
            }
            if WRITE_KEYWORDS.contains(&name.as_str()) {
                facts.writes = true;
            }
            if facts.cannot_follow.is_none() && name == "execute" {
                facts.cannot_follow = Some("it runs SQL built at run time (EXECUTE)".into());
            }
            if name == "operator" && after == Some(&Token::Punct('(')) {
                // OPERATOR(schema.symbol): the symbol is the last token before ')'.
                let symbol = tokens[at + 1..]
                    .iter()
                    .take_while(|token| **token != Token::Punct(')'))
                    .filter_map(|token| match token {
                        Token::Operator(symbol) => Some(symbol.clone()),
                        _ => None,
                    })
                    .last();
                facts.operators.extend(symbol);
                continue;
            }
        }
        if after == Some(&Token::Punct('(')) {
            let schema = match (qualified, at.checked_sub(2).map(|i| &tokens[i])) {
                (true, Some(Token::Word(schema) | Token::Quoted(schema))) => Some(schema.clone()),
                _ => None,
            };
            facts.calls.push(CalledName {
                schema,
                name: name.clone(),
            });
        } else {
            facts.names.push(name.clone());
        }
    }
    facts.calls.dedup();
    facts
        .operators
        .extend(IMPLIED_OPERATORS.iter().map(|symbol| (*symbol).to_owned()));
    facts.operators.sort();
    facts.operators.dedup();
    facts.names.sort();
    facts.names.dedup();
    facts
}

/// The body's tokens, or why it cannot be read for sure.
fn tokens(body: &str) -> Result<Vec<Token>, Unreadable> {
    let chars: Vec<char> = body.chars().collect();
    let mut tokens = Vec::new();
    let mut at = 0;
    let peek = |at: usize| chars.get(at).copied().unwrap_or('\0');
    while at < chars.len() {
        let c = chars[at];
        if matches!(c, ' ' | '\t' | '\n' | '\r' | '\x0b' | '\x0c') {
            at += 1;
        } else if c == '-' && peek(at + 1) == '-' {
            while at < chars.len() && chars[at] != '\n' {
                at += 1;
            }
        } else if c == '/' && peek(at + 1) == '*' {
            at = skip_block_comment(&chars, at)?;
        } else if c == '\'' {
            // An E'...' string was already taken with its prefix below.
            at = skip_standard_string(&chars, at)?;
            tokens.push(Token::Value);
        } else if c == '"' {
            let (name, next) = quoted_name(&chars, at)?;
            tokens.push(Token::Quoted(truncated(name)));
            at = next;
        } else if c == '$' && peek(at + 1).is_ascii_digit() {
            at += 1;
            while peek(at).is_ascii_digit() {
                at += 1;
            }
            tokens.push(Token::Value);
        } else if c == '$' {
            at = skip_dollar_string(&chars, at)?;
            tokens.push(Token::Value);
        } else if c.is_ascii_digit() || (c == '.' && peek(at + 1).is_ascii_digit()) {
            while peek(at).is_ascii_alphanumeric() || matches!(peek(at), '.' | '_') {
                at += 1;
            }
            tokens.push(Token::Value);
        } else if c.is_ascii_alphabetic() || c == '_' || !c.is_ascii() {
            // As PostgreSQL's lexer: every character beyond ASCII is part of a name, and only
            // A-Z are folded.
            let start = at;
            while peek(at).is_ascii_alphanumeric()
                || matches!(peek(at), '_' | '$')
                || (!peek(at).is_ascii() && peek(at) != '\0')
            {
                at += 1;
            }
            let word = truncated(
                chars[start..at]
                    .iter()
                    .collect::<String>()
                    .to_ascii_lowercase(),
            );
            if peek(at) == '\'' {
                // A prefixed string: E'…' (backslash escapes), B'…', X'…', N'…'; or a typed
                // literal (mood'happy'), whose type is a name to follow.
                if !matches!(word.as_str(), "e" | "b" | "x" | "n") {
                    tokens.push(Token::Word(word.clone()));
                }
                at = if word == "e" {
                    skip_escape_string(&chars, at)?
                } else {
                    skip_standard_string(&chars, at)?
                };
                tokens.push(Token::Value);
            } else if word == "u" && peek(at) == '&' && matches!(peek(at + 1), '\'' | '"') {
                if peek(at + 1) == '"' {
                    // Its escapes (and a UESCAPE after it) could spell any name.
                    return Err(Unreadable::UnicodeEscapedName);
                } else {
                    at = skip_standard_string(&chars, at + 1)?;
                    tokens.push(Token::Value);
                }
            } else {
                tokens.push(Token::Word(word));
            }
        } else if OPERATOR_CHARS.contains(c) {
            let start = at;
            while OPERATOR_CHARS.contains(peek(at))
                && !(peek(at) == '-' && peek(at + 1) == '-')
                && !(peek(at) == '/' && peek(at + 1) == '*')
            {
                at += 1;
            }
            if at == start {
                // `--` or `/*` right at the start is a comment, taken on the next turn.
                continue;
            }
            tokens.extend(operator_spellings(chars[start..at].iter().collect()));
        } else {
            tokens.push(Token::Punct(c));
            at += 1;
        }
    }
    Ok(tokens)
}

/// A name as PostgreSQL keeps it: its first 63 bytes, cut at a character's boundary.
fn truncated(mut name: String) -> String {
    if name.len() > NAME_BYTES {
        let mut end = NAME_BYTES;
        while !name.is_char_boundary(end) {
            end -= 1;
        }
        name.truncate(end);
    }
    name
}

/// The operators a written symbol may stand for. PostgreSQL reads `!=` as `<>`, and a symbol
/// ending in `+` or `-` without any of `~!@#^&|`?%` in it as a shorter one followed by `+` or `-`
/// (`=-1`); both readings are followed.
fn operator_spellings(symbol: String) -> Vec<Token> {
    if symbol == "!=" {
        return vec![Token::Operator("<>".into())];
    }
    let mut spellings = vec![Token::Operator(symbol.clone())];
    if symbol.len() > 1
        && symbol.ends_with(['+', '-'])
        && !symbol.contains(['~', '!', '@', '#', '^', '&', '|', '`', '?', '%'])
    {
        let shorter = symbol.trim_end_matches(['+', '-']);
        if !shorter.is_empty() {
            spellings.push(Token::Operator(shorter.to_owned()));
        }
        spellings.push(Token::Operator("+".into()));
        spellings.push(Token::Operator("-".into()));
    }
    spellings
}

fn skip_block_comment(chars: &[char], mut at: usize) -> Result<usize, Unreadable> {
    let mut depth = 0;
    while at + 1 < chars.len() {
        if chars[at] == '/' && chars[at + 1] == '*' {
            depth += 1;
            at += 2;
        } else if chars[at] == '*' && chars[at + 1] == '/' {
            depth -= 1;
            at += 2;
            if depth == 0 {
                return Ok(at);
            }
        } else {
            at += 1;
        }
    }
    Err(Unreadable::UnendedComment)
}

/// Skips a '…' literal (quotes doubled inside). A quote after an odd run of backslashes reads
/// differently when `standard_conforming_strings` is off (which a function may SET): such a body
/// is not read at all.
fn skip_standard_string(chars: &[char], mut at: usize) -> Result<usize, Unreadable> {
    at += 1;
    let mut backslashes = 0;
    while at < chars.len() {
        match chars[at] {
            '\'' if backslashes % 2 == 1 => {
                return Err(Unreadable::TwoWayString);
            }
            '\'' if chars.get(at + 1) == Some(&'\'') => at += 2,
            '\'' => return Ok(at + 1),
            '\\' => {
                backslashes += 1;
                at += 1;
                continue;
            }
            _ => at += 1,
        }
        backslashes = 0;
    }
    Err(Unreadable::UnendedString)
}

/// Skips an E'…' literal, whose backslashes escape the next character.
fn skip_escape_string(chars: &[char], mut at: usize) -> Result<usize, Unreadable> {
    at += 1;
    while at < chars.len() {
        match chars[at] {
            '\\' => at += 2,
            '\'' if chars.get(at + 1) == Some(&'\'') => at += 2,
            '\'' => return Ok(at + 1),
            _ => at += 1,
        }
    }
    Err(Unreadable::UnendedString)
}

/// Skips a $tag$…$tag$ literal (the tag may be empty).
fn skip_dollar_string(chars: &[char], at: usize) -> Result<usize, Unreadable> {
    let mut end = at + 1;
    while end < chars.len()
        && (chars[end].is_ascii_alphanumeric() || chars[end] == '_' || !chars[end].is_ascii())
    {
        end += 1;
    }
    if chars.get(end) != Some(&'$') {
        return Err(Unreadable::StrayDollar);
    }
    let tag: Vec<char> = chars[at..=end].to_vec();
    let mut scan = end + 1;
    while scan + tag.len() <= chars.len() {
        if chars[scan..scan + tag.len()] == tag[..] {
            return Ok(scan + tag.len());
        }
        scan += 1;
    }
    Err(Unreadable::UnendedDollarString)
}

fn quoted_name(chars: &[char], mut at: usize) -> Result<(String, usize), Unreadable> {
    at += 1;
    let mut name = String::new();
    while at < chars.len() {
        if chars[at] == '"' {
            if chars.get(at + 1) == Some(&'"') {
                name.push('"');
                at += 2;
                continue;
            }
            return Ok((name, at + 1));
        }
        name.push(chars[at]);
        at += 1;
    }
    Err(Unreadable::UnendedQuotedName)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn called(facts: &BodyFacts) -> Vec<String> {
        facts
            .calls
            .iter()
            .map(|call| match &call.schema {
                Some(schema) => format!("{schema}.{}", call.name),
                None => call.name.clone(),
            })
            .collect()
    }

    /// The operators written in the body, besides those every body is taken to use.
    fn written(facts: &BodyFacts) -> Vec<String> {
        let mut written = facts.operators.clone();
        written.retain(|symbol| !IMPLIED_OPERATORS.contains(&symbol.as_str()));
        written
    }

    #[test]
    fn finds_the_keywords_that_name_the_role_asking() {
        for (body, keyword) in [
            ("SELECT USER", "USER"),
            ("select current_user", "CURRENT_USER"),
            ("SELECT x FROM t WHERE owner = Session_User", "SESSION_USER"),
            ("BEGIN RETURN current_role; END", "CURRENT_ROLE"),
            ("SHOW app.tenant", "SHOW"),
        ] {
            assert_eq!(
                read_body(body).reads_the_reader.as_deref(),
                Some(keyword),
                "{body}"
            );
        }
    }

    #[test]
    fn a_keyword_in_a_literal_comment_quoted_name_or_column_is_not_code() {
        for body in [
            "SELECT 'current_user'",
            "SELECT $$current_user$$",
            "SELECT $q$ user $q$",
            "SELECT E'it\\'s current_user'",
            "SELECT 1 -- current_user",
            "SELECT 1 /* a /* nested */ current_user */",
            "SELECT \"user\" FROM t",
            "SELECT t.user FROM t",
        ] {
            assert_eq!(read_body(body).reads_the_reader, None, "{body}");
        }
    }

    #[test]
    fn dynamic_sql_cannot_be_followed() {
        let facts = read_body("BEGIN EXECUTE 'SHOW app.tenant' INTO v; RETURN v; END");
        assert!(facts
            .cannot_follow
            .as_deref()
            .is_some_and(|why| why.contains("EXECUTE")));
        // The SHOW inside the string is not seen: the EXECUTE is what refuses it.
        assert_eq!(facts.reads_the_reader, None);
    }

    #[test]
    fn a_literal_that_reads_two_ways_cannot_be_followed() {
        // With standard_conforming_strings off, '\' ends nowhere near where it ends with it on.
        for body in [
            "SELECT 'a\\', ' current_user '",
            "SELECT 'a\\''",
            "SELECT 'never ends",
            "SELECT $x$ never ends",
            "SELECT 1 /* never ends",
        ] {
            assert!(read_body(body).cannot_follow.is_some(), "{body}");
        }
        assert_eq!(read_body("SELECT '\\\\' , 'a\\d+'").cannot_follow, None);
    }

    #[test]
    fn lists_calls_operators_and_names() {
        let facts = read_body(
            "SELECT public.tenant_of(t.id) + lower(\"Name\") OPERATOR(app.===) x::app.mood FROM app.items t",
        );
        assert_eq!(called(&facts), vec!["public.tenant_of", "lower"]);
        assert_eq!(written(&facts), vec!["+", "==="]);
        for name in ["app", "items", "mood", "x", "id", "Name"] {
            assert!(facts.names.contains(&name.to_string()), "{name}");
        }
        assert_eq!(facts.reads_the_reader, None);
        assert_eq!(facts.cannot_follow, None);
    }

    #[test]
    fn names_are_read_as_postgresql_reads_them() {
        // Only A-Z fold; a name is cut to 63 bytes; NBSP and other non-ASCII are name characters.
        let long = format!("evil.{}_hidden()", "a".repeat(63));
        let facts = read_body(&format!(
            "SELECT {long}, evil.\u{3a9}who(), evil.who\u{a0}()"
        ));
        assert_eq!(
            called(&facts),
            vec![
                format!("evil.{}", "a".repeat(63)),
                "evil.\u{3a9}who".to_owned(),
                "evil.who\u{a0}".to_owned()
            ]
        );
        for (body, keyword) in [
            ("SELECT SYSTEM_USER", "SYSTEM_USER"),
            ("SELECT x FROM t WHERE s = current_schema", "CURRENT_SCHEMA"),
        ] {
            assert_eq!(read_body(body).reads_the_reader.as_deref(), Some(keyword));
        }
    }

    #[test]
    fn operators_are_followed_as_postgresql_reads_them() {
        let facts = read_body("SELECT a != b");
        assert!(facts.operators.contains(&"<>".to_owned()));
        assert!(!facts.operators.contains(&"!=".to_owned()));
        let facts = read_body("SELECT a =- 1");
        for symbol in ["=-", "=", "-"] {
            assert!(facts.operators.contains(&symbol.to_owned()), "{symbol}");
        }
    }

    #[test]
    fn operators_applied_without_their_symbol_are_followed() {
        for body in [
            "SELECT 1 WHERE x IN (1, 2)",
            "SELECT 1 WHERE x BETWEEN 1 AND 2",
            "SELECT NULLIF(a, b), CASE a WHEN b THEN 1 END",
            "SELECT 1 FROM a JOIN b USING (id) WHERE a.x IS DISTINCT FROM b.x",
            "SELECT 1 WHERE x LIKE 'a%' OR x ILIKE 'b%' OR x SIMILAR TO 'c'",
        ] {
            let facts = read_body(body);
            for symbol in IMPLIED_OPERATORS {
                assert!(
                    facts.operators.contains(&symbol.to_owned()),
                    "{body}: {symbol}"
                );
            }
        }
    }

    #[test]
    fn a_body_that_writes_is_told_apart() {
        for body in [
            "INSERT INTO log VALUES (1) RETURNING id",
            "BEGIN UPDATE t SET x = 1; RETURN 1; END",
            "DELETE FROM t RETURNING *",
            "MERGE INTO t USING s ON t.id = s.id WHEN MATCHED THEN DO NOTHING",
        ] {
            assert!(read_body(body).writes, "{body}");
        }
        for body in [
            "SELECT 'insert'",
            "SELECT \"update\" FROM t",
            "SELECT t.delete FROM t",
        ] {
            assert!(!read_body(body).writes, "{body}");
        }
    }

    #[test]
    fn a_comment_ends_an_operator() {
        let facts = read_body("SELECT 1 +-- current_user\n 2");
        assert_eq!(written(&facts), vec!["+"]);
        assert_eq!(facts.reads_the_reader, None);
    }

    #[test]
    fn quoted_calls_are_calls_and_unicode_escaped_names_cannot_be_followed() {
        let facts = read_body("SELECT \"current_setting\"('x'), mood'happy'");
        assert_eq!(called(&facts), vec!["current_setting"]);
        assert!(facts.names.contains(&"mood".to_string()));
        let escaped = read_body("SELECT U&\"current\\005fsetting\"('app.tenant')");
        assert!(escaped.cannot_follow.is_some());
    }
}
