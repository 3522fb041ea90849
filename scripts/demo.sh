#!/usr/bin/env bash
# The main job: builds and installs pg_meili_sync, starts a throwaway PostgreSQL with it preloaded,
# syncs a demo table into Meilisearch (MEILI_URL / MEILI_MASTER_KEY, or the bundled test server),
# and prints what landed in the index and the status view.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/install.sh
cargo run --release -q -p pg_meili_sync_e2e --bin demo
