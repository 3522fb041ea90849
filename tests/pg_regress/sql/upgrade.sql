-- Upgrades in place: 0.1.0 installed and updated (through 0.2.0) to 0.3.0 has the very objects a fresh 0.3.0
-- install has (functions and their definitions, tables and their columns, constraints, indexes,
-- views, grants, comments, and what pg_dump keeps). Each install gets a database of its own, made
-- from a template that holds the description of an extension's objects.
CREATE DATABASE regress_upgrade_template;
\c regress_upgrade_template
CREATE FUNCTION describe_extension() RETURNS SETOF text LANGUAGE sql AS $describe$
WITH members AS (
    SELECT d.classid, d.objid, d.objsubid
      FROM pg_depend d
      JOIN pg_extension e ON e.oid = d.refobjid AND d.refclassid = 'pg_extension'::regclass
     WHERE e.extname = 'pg_meili_sync' AND d.deptype = 'e'
), tables AS (
    SELECT c.oid FROM members m JOIN pg_class c ON m.classid = 'pg_class'::regclass AND c.oid = m.objid
)
SELECT 'member ' || pg_describe_object(m.classid, m.objid, m.objsubid) FROM members m
UNION ALL
SELECT 'function ' || p.oid::regprocedure || ' acl ' || coalesce(p.proacl::text, 'default') || E'\n'
       || pg_get_functiondef(p.oid)
  FROM members m JOIN pg_proc p ON m.classid = 'pg_proc'::regclass AND p.oid = m.objid
UNION ALL
SELECT 'relation ' || c.oid::regclass || ' kind ' || c.relkind::text || ' options ' || coalesce(c.reloptions::text, '')
       || ' acl ' || coalesce(c.relacl::text, 'default')
  FROM tables t JOIN pg_class c ON c.oid = t.oid
UNION ALL
SELECT 'column ' || a.attrelid::regclass || '.' || a.attname || ' #' || a.attnum || ' '
       || format_type(a.atttypid, a.atttypmod) || CASE WHEN a.attnotnull THEN ' not null' ELSE '' END
       || coalesce(' default ' || pg_get_expr(ad.adbin, ad.adrelid), '')
       || CASE WHEN a.attidentity <> '' THEN ' identity ' || a.attidentity::text ELSE '' END
       || ' acl ' || coalesce(a.attacl::text, 'default')
  FROM tables t
  JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum > 0 AND NOT a.attisdropped
  LEFT JOIN pg_attrdef ad ON ad.adrelid = a.attrelid AND ad.adnum = a.attnum
UNION ALL
SELECT 'constraint ' || c.conrelid::regclass || ' ' || c.conname || ': ' || pg_get_constraintdef(c.oid)
  FROM tables t JOIN pg_constraint c ON c.conrelid = t.oid
UNION ALL
SELECT 'index ' || pg_get_indexdef(i.indexrelid) FROM tables t JOIN pg_index i ON i.indrelid = t.oid
UNION ALL
SELECT 'trigger ' || pg_get_triggerdef(g.oid) FROM tables t JOIN pg_trigger g ON g.tgrelid = t.oid AND NOT g.tgisinternal
UNION ALL
SELECT 'view ' || c.oid::regclass || E'\n' || pg_get_viewdef(c.oid)
  FROM tables t JOIN pg_class c ON c.oid = t.oid AND c.relkind = 'v'
UNION ALL
SELECT 'sequence ' || s.seqrelid::regclass || ' ' || format_type(s.seqtypid, NULL) || ' from ' || s.seqstart
       || ' by ' || s.seqincrement || ' cache ' || s.seqcache
  FROM tables t JOIN pg_sequence s ON s.seqrelid = t.oid
UNION ALL
SELECT 'schema ' || n.nspname || ' acl ' || coalesce(n.nspacl::text, 'default')
  FROM members m JOIN pg_namespace n ON m.classid = 'pg_namespace'::regclass AND n.oid = m.objid
UNION ALL
SELECT 'comment on ' || pg_describe_object(d.classoid, d.objoid, d.objsubid) || ': ' || d.description
  FROM pg_description d
 WHERE (d.classoid, d.objoid) IN (SELECT m.classid, m.objid FROM members m)
UNION ALL
SELECT 'dumped ' || c.relid::regclass || ' where ''' || c.condition || ''''
  FROM pg_extension e, unnest(e.extconfig, e.extcondition) AS c(relid, condition)
 WHERE e.extname = 'pg_meili_sync'
$describe$;
\c regress
CREATE DATABASE regress_upgraded TEMPLATE regress_upgrade_template;
CREATE DATABASE regress_fresh TEMPLATE regress_upgrade_template;

\c regress_upgraded
CREATE EXTENSION pg_meili_sync VERSION '0.1.0';
SELECT extversion FROM pg_extension WHERE extname = 'pg_meili_sync';
CREATE TABLE products (id bigint PRIMARY KEY, name text);
-- With the SQL objects of another version than the library's, tasks cannot be managed.
SELECT meili_sync_start('products', 'products', '{"url": "http://127.0.0.1:1"}');
-- Lookalike operators in the extension's schema, each an exact type match (which beats
-- pg_catalog's own candidate) for an operator that the 0.1.0 -> 0.2.0 script's status view uses
-- (reltuples > 0, 100.0 * a bigint). The update scripts pin search_path: none is bound.
CREATE FUNCTION public.lookalike_gt(real, integer) RETURNS boolean LANGUAGE sql
    AS 'SELECT $1 OPERATOR(pg_catalog.>) $2::real';
CREATE OPERATOR public.> (LEFTARG = real, RIGHTARG = integer, FUNCTION = public.lookalike_gt);
CREATE FUNCTION public.lookalike_times(numeric, bigint) RETURNS numeric LANGUAGE sql
    AS 'SELECT $1 OPERATOR(pg_catalog.*) $2::numeric';
CREATE OPERATOR public.* (LEFTARG = numeric, RIGHTARG = bigint, FUNCTION = public.lookalike_times);
-- Control: an unqualified query binds them.
CREATE VIEW lookalike_control AS SELECT c.reltuples > 0 AS big, 100.0 * c.relpages::bigint AS pages FROM pg_class c;
SELECT pg_catalog.count(*) AS control_bound FROM pg_depend d
  JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass AND d.refobjid = o.oid
 WHERE o.oprnamespace = 'public'::regnamespace;
DROP VIEW lookalike_control;
ALTER EXTENSION pg_meili_sync UPDATE TO '0.2.0';
SELECT pg_catalog.count(*) AS bound_by_update FROM pg_depend d
  JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass AND d.refobjid = o.oid
 WHERE o.oprnamespace = 'public'::regnamespace;
ALTER EXTENSION pg_meili_sync UPDATE;
SELECT pg_catalog.count(*) AS bound_by_update FROM pg_depend d
  JOIN pg_operator o ON d.refclassid = 'pg_operator'::regclass AND d.refobjid = o.oid
 WHERE o.oprnamespace = 'public'::regnamespace;
SELECT extversion FROM pg_extension WHERE extname = 'pg_meili_sync';
SELECT string_agg(line, chr(30) ORDER BY line) AS upgraded FROM describe_extension() AS line \gset

\c regress_fresh
CREATE EXTENSION pg_meili_sync;
SELECT extversion FROM pg_extension WHERE extname = 'pg_meili_sync';
-- The description is not empty: it has every function, column and view.
SELECT count(*) > 150 AS described,
       count(*) FILTER (WHERE line LIKE 'view %') AS views,
       count(*) FILTER (WHERE line LIKE 'dumped %') AS dumped
  FROM describe_extension() AS line;
-- No object differs.
(SELECT 'only in the updated install: ' || line
   FROM unnest(string_to_array(:'upgraded', chr(30))) AS line
 EXCEPT
 SELECT 'only in the updated install: ' || line FROM describe_extension() AS line)
UNION ALL
(SELECT 'only in the fresh install: ' || line FROM describe_extension() AS line
 EXCEPT
 SELECT 'only in the fresh install: ' || line
   FROM unnest(string_to_array(:'upgraded', chr(30))) AS line)
ORDER BY 1;

\c regress
DROP DATABASE regress_upgraded;
DROP DATABASE regress_fresh;
DROP DATABASE regress_upgrade_template;
