-- Shared by every file: the extension, tables to sync, roles, and a view of what a task leaves
-- behind (catalog rows, secrets, publications), to show that a refused call leaves nothing.
CREATE EXTENSION pg_meili_sync;
CREATE TABLE products (id bigint PRIMARY KEY, name text NOT NULL, price numeric(10,2), tags text[], meta jsonb);
CREATE TABLE no_key (a int, b text);
CREATE TABLE "Weird ""Table""; DROP TABLE products; --" (id int PRIMARY KEY, "select" text);
CREATE TABLE float_key (k float8 PRIMARY KEY, v text);
CREATE TABLE json_key (k jsonb PRIMARY KEY);
CREATE TABLE unique_code (id int, code text NOT NULL UNIQUE);
CREATE UNLOGGED TABLE scratch (id int PRIMARY KEY);
CREATE VIEW products_view AS SELECT * FROM products;
CREATE ROLE regress_reader;
CREATE ROLE regress_monitor IN ROLE pg_monitor;
CREATE ROLE regress_admin IN ROLE meili_sync_admin;
CREATE VIEW leftovers AS
SELECT (SELECT count(*) FROM meili_sync.tasks) AS tasks,
       (SELECT count(*) FROM meili_sync.task_secrets) AS secrets,
       -- Tasks' own publications (the shared decoder makes and drops the shared one by itself).
       (SELECT count(*) FROM pg_catalog.pg_publication WHERE pubname ~ '^meili_sync_[0-9]+_[0-9]+$') AS publications;
