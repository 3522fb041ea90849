-- The dead-letter functions: NULL and unknown task ids.
\set SHOW_CONTEXT never

-- NULL arguments.
SELECT meili_sync_retry_dead_letters(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_discard_dead_letters(NULL);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Tasks that do not exist.
SELECT meili_sync_retry_dead_letters(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_discard_dead_letters(42, ARRAY['1']);
\echo SQLSTATE :LAST_ERROR_SQLSTATE
SELECT meili_sync_discard_dead_letters(42);
\echo SQLSTATE :LAST_ERROR_SQLSTATE

-- Nothing was created.
SELECT * FROM leftovers;
