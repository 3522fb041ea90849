#!/usr/bin/env bash
# The tiers that run on PostgreSQL $1 (16, 17 or 18) beside the whole suite on 15: the extension
# built and installed for that major, the golden SQL files, and an end-to-end set on the test
# server covering copy, streaming (every operation, TOAST, key change, ALTER), faults, security
# attacks, views, search, the shared decoder, partitioned tables, several databases (the DDL guard's ownership check
# differs from 16 on) and failover slots. The core crate has no Postgres in
# it: tier 0b covers it for every major. (The #[pg_test]s run on 15 only: building them for
# another major takes longer than CI can spare.)
#
#   bash scripts/test-major.sh 17               build and install for 17, then test
#   bash scripts/test-major.sh 17 --installed   test what is installed (scripts/test.sh builds it
#                                               in the background while tier 4 runs)
set -euo pipefail
cd "$(dirname "$0")/.."
export PG_MAJOR=$1
source scripts/pg-config.sh

[ "${2:-}" = "--installed" ] || bash scripts/install.sh
echo "== $(date -u +%H:%M:%S) PostgreSQL $PG_MAJOR: golden SQL files"
bash scripts/regress.sh

echo "== $(date -u +%H:%M:%S) PostgreSQL $PG_MAJOR: end to end (a set of each file)"
# The set is gathered with e2e FILE TEST... and run at the end, two at a time (.config/nextest.toml).
filter=""
e2e() {
    local file=$1
    shift
    for test in "$@"; do
        filter="$filter | (binary($file) & test(=$test))"
    done
}
e2e backfill backfill_copies_every_row_exactly
e2e streaming inserts_updates_deletes_and_key_changes unchanged_toast_columns_keep_their_value \
    truncate_empties_the_index_and_later_rows_arrive columns_added_and_dropped_while_streaming \
    streaming_survives_an_immediate_shutdown an_invalidated_slot_stops_the_task_until_a_new_snapshot \
    drop_extension_leaves_nothing_running_and_nothing_retaining_wal
e2e faults failed_tasks_are_resent_without_losing_documents
e2e security a_trap_schema_never_runs_as_superuser \
    a_table_owners_code_runs_as_the_owner_never_as_superuser \
    sigterm_to_each_thread_of_a_busy_worker_never_restarts_the_server \
    an_admin_role_made_by_someone_else_before_the_extension_is_never_taken \
    publications_claimed_first_are_never_adopted_and_changed_ones_are_mended \
    views_that_reach_the_reader_through_functions_at_any_depth_are_refused
e2e trust settings_that_user_code_changes_never_outlive_the_identity_switch
e2e views view_backfill_then_changes_to_every_table \
    view_tasks_stream_in_the_shared_pass_and_one_moves_there_from_its_own_slot
e2e search hits_facets_and_raw_answers_match_the_table a_search_cancelled_mid_answer_raises_the_cancel_alone \
    statement_timeout_cancels_a_search_that_gets_no_answer
e2e shared tasks_share_one_slot_and_each_gets_only_its_table \
    a_killed_decoder_and_an_immediate_shutdown_during_a_catch_up_lose_nothing
e2e edges a_pause_or_drop_of_a_shared_task_applies_from_its_commit
e2e partitions a_partitioned_table_streams_through_every_partition_on_its_own_slot \
    a_partitioned_table_streams_through_every_partition_in_the_shared_pass
e2e upgrade a_restored_dump_brings_the_tasks_back_stopped_until_they_copy_again
e2e databases rename_and_template_copy_work_while_a_task_streams_and_a_copy_runs_none_of_its_tasks
e2e versions the_slots_are_failover_slots_from_postgresql_17_on \
    a_failover_loses_nothing_and_the_index_never_holds_what_the_standby_lacks
# A search replica of a stock publisher: 15 → 18 and 18 → 18 (tier 4 runs 17 → 15).
if [ "$PG_MAJOR" = 18 ]; then
    e2e replica a_replica_of_a_stock_postgresql_15_stays_exact a_replica_of_a_stock_postgresql_18_stays_exact
fi
PATH="$("$PG_CONFIG" --bindir):$PATH" cargo nextest run --cargo-profile ci -p pg_meili_sync_e2e \
    -E "${filter# | }"
