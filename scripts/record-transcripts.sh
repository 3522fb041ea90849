#!/usr/bin/env bash
# Records the transcripts of a real Meilisearch that the test server's fidelity test replays
# (tests/meili-server/tests/transcripts.rs) into tests/meili-server/transcripts/, replacing the
# *.json files there. The binary is MEILI_BIN, or `meilisearch` on PATH; it runs in a temporary
# directory on a free port with a master key, and is stopped at the end. The requests and the
# format are in scripts/record_transcripts.py (Python 3, standard library only). About half a
# minute. Review the diff, then run `cargo test --release -p meili-test-server`.
#   MEILI_BIN=/path/to/meilisearch bash scripts/record-transcripts.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."

bin=${MEILI_BIN:-}
if [ -z "$bin" ]; then
    bin=$(command -v meilisearch || true)
fi
if [ -z "$bin" ]; then
    echo "record-transcripts: no Meilisearch binary: set MEILI_BIN=/path/to/meilisearch or put meilisearch on PATH" >&2
    exit 1
fi
if [ ! -x "$bin" ]; then
    echo "record-transcripts: MEILI_BIN=$bin is not an executable file" >&2
    exit 1
fi
if ! command -v python3 > /dev/null; then
    echo "record-transcripts: python3 is needed" >&2
    exit 1
fi

out=${1:-tests/meili-server/transcripts}
exec python3 scripts/record_transcripts.py --bin "$bin" --out "$out"
