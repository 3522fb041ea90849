//! Whether a view's rows depend on the role or session that reads it. A view task renders each
//! document once, as the view's owner, and every searcher gets the same documents: such a view
//! would give every searcher the rows its owner sees. The check follows every function the view
//! calls, and every function, operator, cast and view those call in turn, to any depth
//! (docs/security.md says what it sees and what it cannot).

use std::collections::{HashSet, VecDeque};

use pgrx::prelude::*;

use pg_meili_sync_core::task::function_body::{read_body, BodyFacts};

use super::fragments::RELATIONS_READ_SQL;
use super::{select_one, CatalogResult};
use crate::error::{ErrorKind, SyncError};

/// Why a view's rows may differ from one reader to another.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReaderDependence {
    /// Something it reaches reads the role asking or a setting: the path to it.
    Reads(String),
    /// A function it reaches cannot be followed (dynamic SQL, a language that cannot be read).
    CannotFollow(String),
}

/// Whether the view is `WITH (security_invoker)`: its base tables are then read with the rights
/// of whoever queries it, so its rows depend on who asks.
pub fn is_security_invoker(view: pg_sys::Oid) -> CatalogResult<bool> {
    Ok(select_one::<bool>(
        "SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_class c,
                               pg_catalog.pg_options_to_table(c.reloptions) o
                         WHERE c.oid OPERATOR(pg_catalog.=) $1
                           AND o.option_name OPERATOR(pg_catalog.=) 'security_invoker'
                           AND o.option_value::pg_catalog.bool)",
        &[view.into()],
    )?
    .unwrap_or(false))
}

/// The rewrite rules' query trees (in their text form) of the view and of every view it reads,
/// each with the view's OID and name.
fn view_trees(view: pg_sys::Oid) -> CatalogResult<Vec<(pg_sys::Oid, String, String)>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "{RELATIONS_READ_SQL}
             SELECT c.oid, pg_catalog.format('%I.%I', n.nspname, c.relname), r.ev_action::pg_catalog.text
               FROM read
               JOIN pg_catalog.pg_class c ON c.oid OPERATOR(pg_catalog.=) read.relid
               JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) c.relnamespace
               JOIN pg_catalog.pg_rewrite r ON r.ev_class OPERATOR(pg_catalog.=) c.oid
              WHERE c.relkind OPERATOR(pg_catalog.=) 'v'
              ORDER BY 2"
            ),
            None,
            &[view.into()],
        )?;
        let mut trees = Vec::new();
        for row in rows {
            trees.push((
                row.get::<pg_sys::Oid>(1)?.unwrap_or(pg_sys::InvalidOid),
                row.get::<String>(2)?.unwrap_or_default(),
                row.get::<String>(3)?.unwrap_or_default(),
            ));
        }
        Ok(trees)
    })
}

/// The numbers that follow each `:<field> ` in a node tree's text form.
fn node_numbers<'a>(tree: &'a str, field: &'a str) -> impl Iterator<Item = u32> + 'a {
    tree.match_indices(field).filter_map(move |(at, _)| {
        let digits: String = tree[at + field.len()..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    })
}

/// The SQL keywords that name the role asking (`CURRENT_USER` and its kin) or its schema, as
/// SQLValueFunction operations (`SYSTEM_USER`, from PostgreSQL 16, is a call of
/// `pg_catalog.system_user()` instead, which the list of functions has).
fn role_keywords() -> [(u32, &'static str); 5] {
    use pg_sys::SQLValueFunctionOp as Op;
    [
        (Op::SVFOP_CURRENT_SCHEMA, "CURRENT_SCHEMA"),
        (Op::SVFOP_CURRENT_ROLE, "CURRENT_ROLE"),
        (Op::SVFOP_CURRENT_USER, "CURRENT_USER"),
        (Op::SVFOP_USER, "USER"),
        (Op::SVFOP_SESSION_USER, "SESSION_USER"),
    ]
}

/// The fields of a query tree that name a function (calls, operators, aggregates, windows).
const FUNCTION_FIELDS: [&str; 4] = [":funcid ", ":opfuncid ", ":aggfnoid ", ":winfnoid "];

/// The condition that a function `p` of `pg_catalog` reads the role asking or a setting.
const BUILTIN_READS_SQL: &str = "p.proname OPERATOR(pg_catalog.=) ANY ('{current_user,session_user,system_user,getpgusername,current_setting,row_security_active,current_schema,current_schemas,inet_client_addr,inet_client_port,pg_backend_pid,pg_my_temp_schema,pg_show_all_settings,pg_client_encoding,currval,lastval,pg_cursor,pg_prepared_statement,pg_stat_get_activity}'::pg_catalog.name[])
      OR (p.proname OPERATOR(pg_catalog.=) 'pg_has_role' AND p.pronargs OPERATOR(pg_catalog.=) 2)
      OR (p.proname OPERATOR(pg_catalog.~) '^has_.*_privilege$'
          AND p.pronargs OPERATOR(pg_catalog.=) CASE WHEN p.proname OPERATOR(pg_catalog.=) 'has_column_privilege' THEN 3 ELSE 2 END)";

/// The condition that a function `p` of `pg_catalog` runs SQL given as text, or reads whatever
/// the role asking may read.
const BUILTIN_RUNS_TEXT_SQL: &str =
    "p.proname OPERATOR(pg_catalog.~) '^(query|cursor|schema|database|table)_to_xml'
      OR p.proname OPERATOR(pg_catalog.=) 'ts_stat'
      OR (p.proname OPERATOR(pg_catalog.=) 'ts_rewrite' AND p.pronargs OPERATOR(pg_catalog.=) 2)";

/// A function as the check sees it.
struct FunctionFacts {
    oid: pg_sys::Oid,
    name: String,
    builtin: bool,
    builtin_reads: bool,
    builtin_runs_text: bool,
    language: String,
    immutable: bool,
    source: String,
    sql_body: Option<String>,
    /// The query trees of its arguments' defaults: the planner adds them to a call.
    argument_defaults: Option<String>,
    /// For an aggregate: the functions that do its work (transition, final, combine, …).
    aggregate_support: Option<Vec<pg_sys::Oid>>,
}

/// The functions among `oids` that need a look: every one outside `pg_catalog`, and those of
/// `pg_catalog` that read the role or a setting or run SQL from text.
fn functions_to_check(oids: &[pg_sys::Oid]) -> CatalogResult<Vec<FunctionFacts>> {
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "SELECT * FROM (
                   SELECT p.oid, p.oid::pg_catalog.regprocedure::pg_catalog.text AS name,
                          n.nspname OPERATOR(pg_catalog.=) 'pg_catalog' AS builtin,
                          ({BUILTIN_READS_SQL}) AS reads, ({BUILTIN_RUNS_TEXT_SQL}) AS runs_text,
                          l.lanname::pg_catalog.text, p.provolatile OPERATOR(pg_catalog.=) 'i',
                          p.prosrc, p.prosqlbody::pg_catalog.text, p.proargdefaults::pg_catalog.text,
                          (SELECT pg_catalog.array_remove(ARRAY[a.aggtransfn, a.aggfinalfn, a.aggcombinefn,
                                      a.aggserialfn, a.aggdeserialfn, a.aggmtransfn, a.aggminvtransfn,
                                      a.aggmfinalfn]::pg_catalog.oid[], 0::pg_catalog.oid)
                             FROM pg_catalog.pg_aggregate a WHERE a.aggfnoid OPERATOR(pg_catalog.=) p.oid)
                     FROM pg_catalog.pg_proc p
                     JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
                     JOIN pg_catalog.pg_language l ON l.oid OPERATOR(pg_catalog.=) p.prolang
                    WHERE p.oid OPERATOR(pg_catalog.=) ANY ($1)) f
                  WHERE NOT f.builtin OR f.reads OR f.runs_text
                  ORDER BY f.oid"
            ),
            None,
            &[oids.to_vec().into()],
        )?;
        let mut functions = Vec::new();
        for row in rows {
            functions.push(FunctionFacts {
                oid: row.get(1)?.unwrap_or(pg_sys::InvalidOid),
                name: row.get(2)?.unwrap_or_default(),
                builtin: row.get(3)?.unwrap_or(false),
                builtin_reads: row.get(4)?.unwrap_or(false),
                builtin_runs_text: row.get(5)?.unwrap_or(false),
                language: row.get(6)?.unwrap_or_default(),
                immutable: row.get(7)?.unwrap_or(false),
                source: row.get(8)?.unwrap_or_default(),
                sql_body: row.get(9)?,
                argument_defaults: row.get(10)?,
                aggregate_support: row.get(11)?,
            });
        }
        Ok(functions)
    })
}

/// The functions a body's text names: called by name (in any schema, when unqualified: which one
/// PostgreSQL picks depends on the search path and the arguments, so each is followed), behind
/// its operators, and the casts to or from the types it names; and the views it names.
fn named_in_body(facts: &BodyFacts) -> CatalogResult<(Vec<pg_sys::Oid>, Vec<pg_sys::Oid>)> {
    let schemas: Vec<String> = facts
        .calls
        .iter()
        .map(|call| call.schema.clone().unwrap_or_default())
        .collect();
    let names: Vec<String> = facts.calls.iter().map(|call| call.name.clone()).collect();
    let functions = select_one::<Vec<pg_sys::Oid>>(
        "SELECT pg_catalog.array_agg(DISTINCT f.oid) FROM (
           SELECT p.oid FROM pg_catalog.pg_proc p
             JOIN pg_catalog.pg_namespace n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
            WHERE EXISTS (SELECT 1 FROM ROWS FROM (pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) c(s, f)
                           WHERE p.proname OPERATOR(pg_catalog.=) c.f
                             AND (c.s OPERATOR(pg_catalog.=) '' OR n.nspname OPERATOR(pg_catalog.=) c.s))
           UNION ALL
           -- row.f calls f(row): attribute notation names a function of one argument.
           SELECT p.oid FROM pg_catalog.pg_proc p
            WHERE p.proname OPERATOR(pg_catalog.=) ANY ($4::pg_catalog.text[])
              AND p.pronargs OPERATOR(pg_catalog.=) 1
           UNION ALL
           -- The planner may use an operator's commutator or negator in its place.
           SELECT x.code FROM pg_catalog.pg_operator o,
                  LATERAL (SELECT o.oprcode::pg_catalog.oid
                           UNION ALL
                           SELECT c.oprcode::pg_catalog.oid FROM pg_catalog.pg_operator c
                            WHERE c.oid OPERATOR(pg_catalog.=) ANY (ARRAY[o.oprcom, o.oprnegate])) x(code)
            WHERE o.oprname OPERATOR(pg_catalog.=) ANY ($3::pg_catalog.text[])
              -- pg_catalog's operators call pg_catalog's functions (only superusers make them),
              -- none of which reads the reader: every body is taken to use `=` and its kin, so
              -- leaving them out saves looking at hundreds.
              AND o.oprnamespace OPERATOR(pg_catalog.<>) 'pg_catalog'::pg_catalog.regnamespace
              AND x.code OPERATOR(pg_catalog.<>) 0
           UNION ALL
           SELECT c.castfunc FROM pg_catalog.pg_cast c
             JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) c.casttarget
                                       OR t.oid OPERATOR(pg_catalog.=) c.castsource
            WHERE t.typname OPERATOR(pg_catalog.=) ANY ($4::pg_catalog.text[])
              AND c.castfunc OPERATOR(pg_catalog.<>) 0) f",
        &[
            schemas.into(),
            names.into(),
            facts.operators.clone().into(),
            facts.names.clone().into(),
        ],
    )?
    .unwrap_or_default();
    let views = select_one::<Vec<pg_sys::Oid>>(
        "SELECT pg_catalog.array_agg(c.oid) FROM pg_catalog.pg_class c
          WHERE c.relname OPERATOR(pg_catalog.=) ANY ($1::pg_catalog.text[])
            AND c.relkind OPERATOR(pg_catalog.=) 'v'",
        &[facts.names.clone().into()],
    )?
    .unwrap_or_default();
    Ok((functions, views))
}

/// The fields of a query tree that name a type: a domain's CHECK constraints run where a value
/// of it is made.
const TYPE_FIELDS: [&str; 5] = [
    ":resulttype ",
    ":consttype ",
    ":vartype ",
    ":paramtype ",
    ":funcresulttype ",
];

/// The functions of the operators' commutators and negators: the planner may use them instead
/// (`NOT (a = b)` becomes `a <> b`, `1 < x` becomes `x > 1`).
fn commutators_and_negators(operators: &[pg_sys::Oid]) -> CatalogResult<Vec<pg_sys::Oid>> {
    if operators.is_empty() {
        return Ok(Vec::new());
    }
    Ok(select_one::<Vec<pg_sys::Oid>>(
        "SELECT pg_catalog.array_agg(DISTINCT c.oprcode::pg_catalog.oid)
           FROM pg_catalog.pg_operator o
           JOIN pg_catalog.pg_operator c ON c.oid OPERATOR(pg_catalog.=) ANY (ARRAY[o.oprcom, o.oprnegate])
          WHERE o.oid OPERATOR(pg_catalog.=) ANY ($1) AND c.oprcode::pg_catalog.oid OPERATOR(pg_catalog.<>) 0",
        &[operators.to_vec().into()],
    )?
    .unwrap_or_default())
}

/// The functions of the casts PostgreSQL applies without their being written: implicit and
/// assignment casts, and casts to `json` or `jsonb` (`to_json` and its kin, and the render of a
/// document, call them). Those written in C were installed by a superuser, as every C function.
fn casts_applied_unwritten() -> CatalogResult<Vec<pg_sys::Oid>> {
    Ok(select_one::<Vec<pg_sys::Oid>>(
        "SELECT pg_catalog.array_agg(DISTINCT c.castfunc ORDER BY c.castfunc)
           FROM pg_catalog.pg_cast c
           JOIN pg_catalog.pg_proc p ON p.oid OPERATOR(pg_catalog.=) c.castfunc
           JOIN pg_catalog.pg_language l ON l.oid OPERATOR(pg_catalog.=) p.prolang
          WHERE l.lanname OPERATOR(pg_catalog.<>) ALL ('{c,internal}'::pg_catalog.name[])
            AND (c.castcontext OPERATOR(pg_catalog.=) ANY ('{i,a}'::pg_catalog.char[])
                 OR c.casttarget OPERATOR(pg_catalog.=) ANY ('{json,jsonb}'::pg_catalog.regtype[]))",
        &[],
    )?
    .unwrap_or_default())
}

/// What PostgreSQL runs on its own around the relations and types a tree or body reaches, each
/// with what it is: the row security policies of the relations (their `current_user` is the
/// reader's), the CHECK constraints of the domains (and of the domains they are made from); and,
/// where `writes`, the column defaults, CHECK constraints, domains of the columns, and triggers
/// of the relations. Relations and types come as OIDs, or as names from a body's text (in any
/// schema). Returns the query trees and the trigger functions.
struct AroundQuery<'a> {
    relations: &'a [pg_sys::Oid],
    relation_names: &'a [String],
    types: &'a [pg_sys::Oid],
    type_names: &'a [String],
    writes: bool,
}

/// See [`AroundQuery`].
type Around = (Vec<(String, String)>, Vec<(String, pg_sys::Oid)>);

fn around(query: &AroundQuery) -> CatalogResult<Around> {
    const SCOPE: &str = "WITH RECURSIVE rel AS (
             SELECT c.oid FROM pg_catalog.pg_class c
              WHERE c.oid OPERATOR(pg_catalog.=) ANY ($1) OR c.relname OPERATOR(pg_catalog.=) ANY ($2::pg_catalog.name[])
           ), domains(oid) AS (
             SELECT t.oid FROM pg_catalog.pg_type t
              WHERE t.typtype OPERATOR(pg_catalog.=) 'd'
                AND (t.oid OPERATOR(pg_catalog.=) ANY ($3) OR t.typname OPERATOR(pg_catalog.=) ANY ($4::pg_catalog.name[])
                     OR ($5 AND t.oid OPERATOR(pg_catalog.=) ANY (ARRAY(SELECT a.atttypid FROM pg_catalog.pg_attribute a JOIN rel ON a.attrelid OPERATOR(pg_catalog.=) rel.oid
                                           WHERE a.attnum OPERATOR(pg_catalog.>) 0 AND NOT a.attisdropped))))
             UNION
             SELECT b.oid FROM domains d
               JOIN pg_catalog.pg_type t ON t.oid OPERATOR(pg_catalog.=) d.oid
               JOIN pg_catalog.pg_type b ON b.oid OPERATOR(pg_catalog.=) t.typbasetype
              WHERE b.typtype OPERATOR(pg_catalog.=) 'd'
           )";
    if query.relations.is_empty()
        && query.relation_names.is_empty()
        && query.types.is_empty()
        && query.type_names.is_empty()
    {
        return Ok((Vec::new(), Vec::new()));
    }
    let args = || {
        vec![
            query.relations.to_vec().into(),
            query.relation_names.to_vec().into(),
            query.types.to_vec().into(),
            query.type_names.to_vec().into(),
            query.writes.into(),
        ]
    };
    Spi::connect(|client| {
        let rows = client.select(
            &format!(
                "{SCOPE}
                 SELECT x.what, x.tree FROM (
                   SELECT pg_catalog.format('policy %I on %s%s', p.polname, p.polrelid::pg_catalog.regclass, e.clause) AS what,
                          e.tree
                     FROM pg_catalog.pg_policy p JOIN rel ON p.polrelid OPERATOR(pg_catalog.=) rel.oid,
                          LATERAL (VALUES ('', p.polqual::pg_catalog.text),
                                          (' (WITH CHECK)', CASE WHEN $5 THEN p.polwithcheck::pg_catalog.text END)) e(clause, tree)
                    WHERE e.tree IS NOT NULL
                   UNION ALL
                   SELECT pg_catalog.format('the default of column %I of %s', a.attname, d.adrelid::pg_catalog.regclass),
                          d.adbin::pg_catalog.text
                     FROM pg_catalog.pg_attrdef d JOIN rel ON d.adrelid OPERATOR(pg_catalog.=) rel.oid
                     JOIN pg_catalog.pg_attribute a ON a.attrelid OPERATOR(pg_catalog.=) d.adrelid AND a.attnum OPERATOR(pg_catalog.=) d.adnum
                    WHERE $5
                   UNION ALL
                   SELECT pg_catalog.format('constraint %I of %s', c.conname, c.conrelid::pg_catalog.regclass),
                          c.conbin::pg_catalog.text
                     FROM pg_catalog.pg_constraint c JOIN rel ON c.conrelid OPERATOR(pg_catalog.=) rel.oid
                    WHERE $5 AND c.conbin IS NOT NULL
                   UNION ALL
                   SELECT pg_catalog.format('constraint %I of domain %s', c.conname, c.contypid::pg_catalog.regtype),
                          c.conbin::pg_catalog.text
                     FROM pg_catalog.pg_constraint c JOIN domains d ON c.contypid OPERATOR(pg_catalog.=) d.oid
                    WHERE c.conbin IS NOT NULL) x
                 ORDER BY 1"
            ),
            None,
            &args(),
        )?;
        let mut trees = Vec::new();
        for row in rows {
            trees.push((
                row.get::<String>(1)?.unwrap_or_default(),
                row.get::<String>(2)?.unwrap_or_default(),
            ));
        }
        let mut triggers = Vec::new();
        if query.writes {
            let rows = client.select(
                &format!(
                    "{SCOPE}
                     SELECT pg_catalog.format('trigger %I on %s', g.tgname, g.tgrelid::pg_catalog.regclass), g.tgfoid
                       FROM pg_catalog.pg_trigger g JOIN rel ON g.tgrelid OPERATOR(pg_catalog.=) rel.oid
                      ORDER BY 1"
                ),
                None,
                &args(),
            )?;
            for row in rows {
                triggers.push((
                    row.get::<String>(1)?.unwrap_or_default(),
                    row.get::<pg_sys::Oid>(2)?.unwrap_or(pg_sys::InvalidOid),
                ));
            }
        }
        Ok((trees, triggers))
    })
}

/// A walk over what a view reaches, each function and view once.
#[derive(Default)]
struct Walk {
    seen_functions: HashSet<pg_sys::Oid>,
    seen_views: HashSet<pg_sys::Oid>,
    /// Policies, defaults and constraints looked at (by what they are).
    seen_trees: HashSet<String>,
    /// Functions to look at, with the path that reached them.
    queue: VecDeque<(pg_sys::Oid, String)>,
}

impl Walk {
    fn enqueue(&mut self, functions: impl IntoIterator<Item = pg_sys::Oid>, path: &str) {
        for function in functions {
            if self.seen_functions.insert(function) {
                self.queue.push_back((function, path.to_owned()));
            }
        }
    }

    /// Looks at a query tree (a view's, or a function's `BEGIN ATOMIC` body) reached by `path`:
    /// what it uses or calls is told as "`path` uses …" (a view's) or "`path`, which uses …"
    /// (a function's).
    fn tree(
        &mut self,
        tree: &str,
        path: &str,
        of_function: bool,
    ) -> CatalogResult<Option<ReaderDependence>> {
        let subject = if of_function {
            format!("{path}, which")
        } else {
            path.to_owned()
        };
        for op in node_numbers(tree, "{SQLVALUEFUNCTION :op ") {
            if let Some((_, keyword)) = role_keywords().iter().find(|(code, _)| *code == op) {
                return Ok(Some(ReaderDependence::Reads(format!(
                    "{subject} uses {keyword}"
                ))));
            }
        }
        let mut functions = Vec::new();
        for field in FUNCTION_FIELDS {
            functions.extend(node_numbers(tree, field).map(pg_sys::Oid::from));
        }
        let operators: Vec<pg_sys::Oid> = node_numbers(tree, ":opno ")
            .map(pg_sys::Oid::from)
            .collect();
        functions.extend(commutators_and_negators(&operators)?);
        self.enqueue(functions, &subject);
        let relations: Vec<pg_sys::Oid> = node_numbers(tree, ":relid ")
            .map(pg_sys::Oid::from)
            .collect();
        for &relation in &relations {
            if let Some(found) = self.view(relation, path)? {
                return Ok(Some(found));
            }
        }
        let mut type_numbers: Vec<u32> = TYPE_FIELDS
            .iter()
            .flat_map(|field| node_numbers(tree, field))
            .collect();
        type_numbers.sort_unstable();
        type_numbers.dedup();
        let types: Vec<pg_sys::Oid> = type_numbers.into_iter().map(pg_sys::Oid::from).collect();
        // A view holds no writes; a function's `BEGIN ATOMIC` body may (CMD_UPDATE, CMD_INSERT,
        // CMD_DELETE, CMD_MERGE).
        let writes = of_function
            && node_numbers(tree, ":commandType ").any(|command| {
                [
                    pg_sys::CmdType::CMD_UPDATE,
                    pg_sys::CmdType::CMD_INSERT,
                    pg_sys::CmdType::CMD_DELETE,
                    pg_sys::CmdType::CMD_MERGE,
                ]
                .contains(&command)
            });
        self.around(
            &AroundQuery {
                relations: &relations,
                relation_names: &[],
                types: &types,
                type_names: &[],
                writes,
            },
            &subject,
        )
    }

    /// Looks at what PostgreSQL runs on its own around what `subject` reaches
    /// ([`AroundQuery`]); `subject` is "view …" or "… calls f(), which".
    fn around(
        &mut self,
        query: &AroundQuery,
        subject: &str,
    ) -> CatalogResult<Option<ReaderDependence>> {
        let (trees, triggers) = around(query)?;
        for (what, function) in triggers {
            self.enqueue([function], &format!("{subject} sets off {what}, which"));
        }
        for (what, tree) in trees {
            if !self.seen_trees.insert(what.clone()) {
                continue;
            }
            if let Some(found) = self.tree(&tree, &format!("{subject} meets {what}"), true)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// Looks at a view (nothing if `relid` is not one) and every view it reads.
    fn view(&mut self, relid: pg_sys::Oid, path: &str) -> CatalogResult<Option<ReaderDependence>> {
        if !self.seen_views.insert(relid) {
            return Ok(None);
        }
        let trees = view_trees(relid)?;
        // The views it reads are looked at here, once: their OIDs in the trees lead nowhere new.
        self.seen_views.extend(trees.iter().map(|(oid, _, _)| *oid));
        for (_, name, tree) in trees {
            let path = if path.is_empty() {
                format!("view {name}")
            } else {
                format!("{path}, which reads view {name}")
            };
            if let Some(found) = self.tree(&tree, &path, false)? {
                return Ok(Some(found));
            }
        }
        Ok(None)
    }

    /// Looks at the functions queued, and at what they reach, until none is left.
    fn functions(&mut self) -> CatalogResult<Option<ReaderDependence>> {
        while !self.queue.is_empty() {
            let batch: Vec<(pg_sys::Oid, String)> = self.queue.drain(..).collect();
            let oids: Vec<pg_sys::Oid> = batch.iter().map(|(oid, _)| *oid).collect();
            for function in functions_to_check(&oids)? {
                let reached_by = batch
                    .iter()
                    .find(|(oid, _)| *oid == function.oid)
                    .map(|(_, path)| path.as_str())
                    .unwrap_or_default();
                let path = format!("{reached_by} calls {}", function.name);
                if let Some(found) = self.function(&function, &path)? {
                    return Ok(Some(found));
                }
            }
        }
        Ok(None)
    }

    fn function(
        &mut self,
        function: &FunctionFacts,
        path: &str,
    ) -> CatalogResult<Option<ReaderDependence>> {
        let cannot_follow = |why: &str| -> CatalogResult<Option<ReaderDependence>> {
            Ok(Some(ReaderDependence::CannotFollow(format!(
                "{path}, which cannot be followed: {why}"
            ))))
        };
        if function.builtin {
            if function.builtin_reads {
                return Ok(Some(ReaderDependence::Reads(format!(
                    "{path}, which reads the current role or a setting"
                ))));
            }
            if function.builtin_runs_text {
                return cannot_follow(
                    "it runs SQL given as text, or reads what the role asking may read",
                );
            }
            return Ok(None);
        }
        if let Some(support) = &function.aggregate_support {
            self.enqueue(support.iter().copied(), &format!("{path}, which"));
            return Ok(None);
        }
        if let Some(defaults) = &function.argument_defaults {
            if let Some(found) =
                self.tree(defaults, &format!("{path} (an argument's default)"), true)?
            {
                return Ok(Some(found));
            }
        }
        match function.language.as_str() {
            // Only superusers install C; IMMUTABLE declares that it reads no role or setting.
            "c" | "internal" if function.immutable => Ok(None),
            "c" | "internal" => cannot_follow(
                "it is written in C and not IMMUTABLE, so what it reads cannot be seen",
            ),
            "sql" if function.sql_body.is_some() => {
                let tree = function.sql_body.as_deref().unwrap_or_default();
                self.tree(tree, path, true)
            }
            "sql" | "plpgsql" => {
                let facts = read_body(&function.source);
                if let Some(keyword) = &facts.reads_the_reader {
                    return Ok(Some(ReaderDependence::Reads(format!(
                        "{path}, which uses {keyword}"
                    ))));
                }
                if let Some(why) = &facts.cannot_follow {
                    return cannot_follow(why);
                }
                let (functions, views) = named_in_body(&facts)?;
                self.enqueue(functions, &format!("{path}, which"));
                for view in views {
                    if let Some(found) = self.view(view, path)? {
                        return Ok(Some(found));
                    }
                }
                // `INSERT INTO t (a, b)` reads as a call of t: called names count too.
                let mut names = facts.names.clone();
                names.extend(facts.calls.iter().map(|call| call.name.clone()));
                self.around(
                    &AroundQuery {
                        relations: &[],
                        relation_names: &names,
                        types: &[],
                        type_names: &names,
                        writes: facts.writes,
                    },
                    &format!("{path}, which"),
                )
            }
            language => cannot_follow(&format!(
                "it is written in {language}, which the check cannot read"
            )),
        }
    }
}

/// What makes the rows of the view depend on the role or session that reads it, if anything:
/// `CURRENT_USER` and its kin, PostgreSQL's functions that read the current role or a setting,
/// anywhere in what the view reaches; or a function on the way that cannot be followed.
pub fn reader_dependence(view: pg_sys::Oid) -> CatalogResult<Option<ReaderDependence>> {
    let mut walk = Walk::default();
    if let Some(found) = walk.view(view, "")? {
        return Ok(Some(found));
    }
    walk.enqueue(
        casts_applied_unwritten()?,
        "a cast PostgreSQL may apply without its being written (implicit, on assignment, or to JSON)",
    );
    walk.functions()
}

const READER_HINT: &str = "A view task renders each document once, as the view's owner, and every role that may search the task gets the same documents. Sync a view whose rows are the same for every reader (a view without security_invoker, filtering by data rather than by the role), and grant SELECT on it only to roles that may see all of them.";

/// Refuses a view whose rows depend on who reads it: a `security_invoker` view (its base tables
/// read with the reader's rights), or one that reaches the role asking or a setting, or a
/// function that cannot be followed. `declared_by`: the role that started the task, when its
/// options declare `"reader_independent": true`; the declaration stands in for the check only
/// while that role owns the view (as PostgreSQL counts owning: it has the owner's privileges).
pub fn refuse_rows_by_who_asks(
    relid: pg_sys::Oid,
    view: &str,
    declared_by: Option<pg_sys::Oid>,
) -> Result<(), SyncError> {
    if is_security_invoker(relid)? {
        return Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("view {view} cannot be synced: it is security_invoker, so its rows depend on who reads it"),
        )
        .hint(READER_HINT));
    }
    if let Some(role) = declared_by {
        let owns = select_one::<bool>(
            "SELECT CASE WHEN EXISTS (SELECT 1 FROM pg_catalog.pg_roles r WHERE r.oid OPERATOR(pg_catalog.=) $2)
                         THEN pg_catalog.pg_has_role($2, c.relowner, 'USAGE') ELSE false END
               FROM pg_catalog.pg_class c WHERE c.oid OPERATOR(pg_catalog.=) $1",
            &[relid.into(), role.into()],
        )?;
        if owns == Some(true) {
            return Ok(());
        }
        return Err(SyncError::new(
            ErrorKind::Privilege,
            format!("view {view} cannot be declared \"reader_independent\": the role that starts the task does not own it"),
        )
        .hint("Only the view's owner (or a role with its privileges) may declare that its rows are the same for every reader. Start the task as the view's owner, or leave the option out to have the view checked."));
    }
    match reader_dependence(relid)? {
        None => Ok(()),
        Some(ReaderDependence::Reads(what)) => Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("view {view} cannot be synced: its rows depend on who reads it ({what})"),
        )
        .hint(READER_HINT)),
        Some(ReaderDependence::CannotFollow(what)) => Err(SyncError::new(
            ErrorKind::UnsupportedType,
            format!("view {view} cannot be synced: whether its rows depend on who reads it cannot be checked ({what})"),
        )
        .hint("If you own the view and its rows are the same for every role that reads it, start the task with the option \"reader_independent\": true, which declares so in place of the check. Otherwise rewrite the function without dynamic SQL, in SQL or PL/pgSQL.")),
    }
}
