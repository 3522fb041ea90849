#!/usr/bin/env python3
"""Tier 0: the docs name only what exists, and the README documents every function, option and GUC.

Fails (exit 1, one line per problem) when:

  a) a Markdown file of the repository (README.md, ARCHITECTURE.md, CONTRIBUTING.md, docs/*.md and
     any other *.md outside target/) names in backticks, or as a link target, a repository path
     that does not exist. Only tokens that look like paths count: they contain a `/` and end in a
     known extension (.rs .sh .py .sql .md .toml .out ...), end in `/`, or start with a top-level
     directory of the repository (`tests/meili-server`). A path may be relative to the repository
     root, to the Markdown file's directory, or to one of SEARCH_DIRS (so that `worker/stream.rs`
     finds `src/worker/stream.rs`); `*` is a glob. `path.rs::item` checks both halves.
  b) such a file names in backticks a Rust item by its module path (`catalog::set_state`,
     `Streamer::new`, `Stop::Permanent`, optionally with `()`), and no .rs file under src/,
     crates/, tests/ or benches/ defines the last segment (fn, struct, enum, trait, const, static,
     type, mod, macro_rules!, an enum variant or a struct field). When the segment before it names
     a module of src/ or crates/core/src (`stream::Streamer`, `worker::stream`), the item must be
     defined in that module's file (or folder); in `path.rs::item`, in that file. Paths into other
     crates (pg_sys::, std::, ...) are skipped: see EXTERNAL_CRATES.
  c) a link to a section (`file.md#anchor`, or `#anchor` in the same file) names no heading of that
     file, as GitHub turns headings into anchors.
  d) a SQL function of the extension has no entry in README.md: a table row whose first cell
     holds `name(...`. Functions are the #[pg_extern] and #[pg_trigger] functions in src/ (the
     attribute's name = "..." or the fn's own name; test code is skipped) and the CREATE FUNCTION
     statements in sql/*.sql. INTERNAL_FUNCTIONS lists the ones users are not meant to call.
  e) a view of the extension (CREATE VIEW in sql/*.sql) is not named in backticks in README.md.
  f) a task option (KNOWN_OPTIONS in crates/core/src/options.rs) is not in the first column of a
     table row of README.md's "Options" section.
  g) a setting (every c"meili_sync.<name>" in src/gucs.rs) is not in the first column of a table
     row of README.md.

    python3 scripts/check-docs.py              check this checkout
    python3 scripts/check-docs.py --root DIR   check another tree (say, a copy with a bogus path)
    python3 scripts/check-docs.py -v           also print what was read
"""

import argparse
import glob
import os
import re
import sys

# Where a path in the docs may be relative to (besides the repository root and the file's own
# directory): crate-internal module paths such as `worker/stream.rs` or `meili/client.rs`, and
# test paths such as `tests/observed.rs` (tests/meili-server) or `tests/trust.rs` (tests/e2e), and
# the golden files' `sql/` and `expected/` (tests/pg_regress).
SEARCH_DIRS = [
    "src",
    "crates/core/src",
    "crates/core/src/meili",
    "tests",
    "tests/e2e",
    "tests/e2e/tests",
    "tests/meili-server",
    "tests/pg_regress",
    "benches",
]

PATH_EXTENSIONS = ("rs", "sh", "py", "sql", "md", "toml", "out", "yml", "yaml", "json", "control", "lock")

# Module paths into crates that are not ours: their items are not defined in this repository.
EXTERNAL_CRATES = {"pg_sys", "pgrx", "std", "core", "alloc", "serde", "serde_json", "ureq", "libc",
                   "flate2", "criterion",
                   # pgrx's types, named without their crate
                   "BackgroundWorker", "PgTryBuilder", "JsonB", "TableIterator", "GucRegistry", "SpiClient"}

# SQL type names: `x::text` in backticks is a cast, not a Rust path.
SQL_TYPES = {"text", "bigint", "int", "integer", "int2", "int4", "int8", "smallint", "uuid", "regclass",
             "regprocedure", "oid", "name", "json", "jsonb", "pg_lsn", "numeric", "boolean", "bool",
             "interval", "date", "timestamp", "timestamptz", "bytea", "float8", "float4", "real"}

# Functions of the extension that users are not meant to call, so the README need not document
# them (it names them once, as internals, under "SQL reference"):
INTERNAL_FUNCTIONS = {
    # behind the meili_sync_status view (sql/views.sql joins it with the catalog)
    "meili_sync_worker_state",
    "meili_sync_readable_error",
    # behind the pg_stat_meili_sync view
    "meili_sync_stats",
    # behind the meili_sync_waits view
    "meili_sync_waiting",
    # the engine of meili_sync_wait, which sql/views.sql defines with pg_lsn and interval arguments
    "meili_sync_wait_at",
    # the trigger function of the search_targets triggers on meili_sync.tasks and task_secrets
    "meili_sync_invalidate_search_targets",
}

SKIP_DIRS = {"target", ".git", "node_modules"}

MODULE_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(::[A-Za-z_][A-Za-z0-9_]*)+(\(\))?$")
PATH_CHARS = r"[A-Za-z0-9_.*@+-]"
PATH_WITH_EXT = re.compile(
    r"^(\./)?(%s+/)+%s+\.(%s)$" % (PATH_CHARS, PATH_CHARS, "|".join(PATH_EXTENSIONS)))
DIR_PATH = re.compile(r"^(\./)?(%s+/)+$" % PATH_CHARS)
PLAIN_PATH = re.compile(r"^(%s+/)+%s+$" % (PATH_CHARS, PATH_CHARS))
PATH_AND_ITEM = re.compile(r"^(?P<path>.+\.rs)::(?P<item>[A-Za-z_][A-Za-z0-9_]*)(\(\))?$")


class Checker:
    def __init__(self, root, verbose):
        self.root = os.path.abspath(root)
        self.verbose = verbose
        self.problems = []
        self._names_by_file = None
        self.checked = {"paths": 0, "items": 0, "links": 0}
        self.top_dirs = {name for name in os.listdir(self.root)
                         if os.path.isdir(os.path.join(self.root, name)) and name not in SKIP_DIRS}

    def problem(self, where, message):
        self.problems.append("%s: %s" % (where, message))

    def note(self, message):
        if self.verbose:
            print("check-docs: " + message)

    def read(self, relative):
        with open(os.path.join(self.root, relative), encoding="utf-8") as handle:
            return handle.read()

    # ---- Markdown -------------------------------------------------------------------------------

    def markdown_files(self):
        found = []
        for directory, subdirs, files in os.walk(self.root):
            subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
            for name in sorted(files):
                if name.endswith(".md"):
                    found.append(os.path.relpath(os.path.join(directory, name), self.root))
        return found

    @staticmethod
    def blank_fences(text):
        """The text with fenced code blocks blanked out (line numbers kept)."""
        out, fence = [], None
        for line in text.split("\n"):
            stripped = line.lstrip()
            marker = re.match(r"(`{3,}|~{3,})", stripped)
            if fence is None and marker:
                fence = marker.group(1)[0] * 3
                out.append("")
            elif fence is not None:
                if stripped.startswith(fence):
                    fence = None
                out.append("")
            else:
                out.append(line)
        return "\n".join(out)

    @staticmethod
    def code_spans(text):
        """(line number, content) of every inline code span; a span may wrap a line."""
        spans = []
        for match in re.finditer(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", text, re.S):
            content = match.group(2)
            if "\n\n" in content:
                continue
            line = text.count("\n", 0, match.start()) + 1
            spans.append((line, " ".join(content.split())))
        return spans

    @staticmethod
    def links(text):
        """(line number, target) of every inline link, code spans removed first."""
        without_code = re.sub(r"`[^`\n]*`", lambda m: " " * len(m.group(0)), text)
        found = []
        for match in re.finditer(r"\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)", without_code):
            line = without_code.count("\n", 0, match.start()) + 1
            found.append((line, match.group(1)))
        return found

    @staticmethod
    def anchors(text):
        """The anchors GitHub gives the headings of a Markdown text."""
        seen, anchors = {}, set()
        for line in Checker.blank_fences(text).split("\n"):
            heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
            if not heading:
                continue
            title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))
            slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else "%s-%d" % (slug, count))
        return anchors

    # ---- paths ----------------------------------------------------------------------------------

    def path_exists(self, token, md_dir):
        bases = ["", md_dir] + SEARCH_DIRS
        for base in bases:
            candidate = os.path.normpath(os.path.join(self.root, base, token))
            if not candidate.startswith(self.root):
                continue
            if "*" in token:
                if glob.glob(candidate):
                    return True
            elif token.endswith("/"):
                if os.path.isdir(candidate):
                    return True
            elif os.path.exists(candidate):
                return True
        return False

    def looks_like_path(self, token):
        if PATH_WITH_EXT.match(token) or DIR_PATH.match(token):
            return True
        return bool(PLAIN_PATH.match(token)) and token.split("/")[0] in self.top_dirs

    def check_path(self, where, token, md_dir, how):
        self.checked["paths"] += 1
        if not self.path_exists(token, md_dir):
            self.problem(where, "%s `%s` names no file or directory of the repository (looked under "
                                "the root, the file's directory and %s)" % (how, token, ", ".join(SEARCH_DIRS)))

    # ---- Rust items -----------------------------------------------------------------------------

    def rust_files(self):
        for top in ("src", "crates", "tests", "benches"):
            for directory, subdirs, files in os.walk(os.path.join(self.root, top)):
                subdirs[:] = [d for d in subdirs if d not in SKIP_DIRS]
                for name in files:
                    if name.endswith(".rs"):
                        yield os.path.join(directory, name)

    def names_by_file(self):
        """Every name each .rs file of the repository defines, by path."""
        if self._names_by_file is not None:
            return self._names_by_file
        definition = re.compile(
            r"\b(?:fn|struct|enum|trait|const|static|type|mod|union)\s+([A-Za-z_][A-Za-z0-9_]*)"
            r"|\bmacro_rules!\s*([A-Za-z_][A-Za-z0-9_]*)")
        by_file = {}
        for path in self.rust_files():
            with open(path, encoding="utf-8", errors="replace") as handle:
                source = handle.read()
            names = by_file.setdefault(os.path.relpath(path, self.root), set())
            for match in definition.finditer(source):
                names.add(match.group(1) or match.group(2))
            for match in re.finditer(r"\b(?:enum|struct)\s+[A-Za-z_][A-Za-z0-9_]*[^{;]*\{", source):
                depth, position, body = 1, match.end(), []
                while position < len(source) and depth:
                    char = source[position]
                    depth += {"{": 1, "}": -1}.get(char, 0)
                    if depth == 1:
                        body.append(char)
                    position += 1
                for line in "".join(body).split("\n"):
                    variant = re.match(r"\s*(?:#\[[^\]]*\]\s*)*([A-Z][A-Za-z0-9_]*)\s*(?:[({,=]|$)", line)
                    field = re.match(r"\s*(?:pub(?:\([a-z]+\))?\s+)?([a-z_][a-z0-9_]*)\s*:(?!:)", line)
                    for found in (variant, field):
                        if found:
                            names.add(found.group(1))
        self._names_by_file = by_file
        self.note("%d Rust item names read" % len(self.items()))
        return by_file

    def items(self):
        """Every name a .rs file of the repository defines."""
        return set().union(*self.names_by_file().values())

    def module_files(self, module):
        """The .rs files of a module of the extension's or the core crate's source named `module`:
        `module.rs`, or every file of a folder `module/` with a mod.rs. Empty when no module has
        that name (then it is a type or another crate's path)."""
        found = []
        for relative in self.names_by_file():
            parts = relative.split(os.sep)
            if parts[0] == "src" or parts[:3] == ["crates", "core", "src"]:
                if parts[-1] == module + ".rs":
                    found.append(relative)
                elif module in parts[:-1] and os.path.exists(
                        os.path.join(self.root, *parts[:parts.index(module) + 1], "mod.rs")):
                    found.append(relative)
        return found

    def check_item(self, where, token, item, files=None):
        """`item` is defined by a .rs file of the repository; by one of `files` when given."""
        self.checked["items"] += 1
        if files:
            if not any(item in self.names_by_file().get(path, set()) for path in files):
                self.problem(where, "`%s`: %s defines no `%s`" % (token, ", ".join(sorted(files)), item))
        elif item not in self.items():
            self.problem(where, "`%s`: no .rs file under src/, crates/, tests/ or benches/ defines `%s`"
                         % (token, item))

    # ---- (a), (b), (c) --------------------------------------------------------------------------

    def check_markdown(self):
        anchors_of = {}
        for relative in self.markdown_files():
            text = self.read(relative)
            anchors_of[relative] = self.anchors(text)
        for relative in self.markdown_files():
            md_dir = os.path.dirname(relative)
            prose = self.blank_fences(self.read(relative))
            spans = self.code_spans(prose)
            self.note("%s: %d code spans" % (relative, len(spans)))
            for line, token in spans:
                where = "%s:%d" % (relative, line)
                with_item = PATH_AND_ITEM.match(token)
                if with_item:
                    if self.looks_like_path(with_item.group("path")):
                        self.check_path(where, with_item.group("path"), md_dir, "path")
                    in_file = [path for path in self.names_by_file()
                               if (os.sep + path).endswith(os.sep + with_item.group("path"))]
                    self.check_item(where, token, with_item.group("item"), in_file)
                elif self.looks_like_path(token):
                    self.check_path(where, token, md_dir, "path")
                elif MODULE_PATH.match(token):
                    segments = token.rstrip("()").split("::")
                    if segments[0] in EXTERNAL_CRATES or segments[-1] in SQL_TYPES:
                        continue
                    # `stream::Streamer`: the item must be in the module it is named with.
                    self.check_item(where, token, segments[-1], self.module_files(segments[-2]))
            for line, target in self.links(prose):
                where = "%s:%d" % (relative, line)
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):
                    continue  # http:, https:, mailto:
                self.checked["links"] += 1
                path, _, anchor = target.partition("#")
                if path:
                    if path.startswith("/"):
                        self.problem(where, "link `%s` is absolute: make it relative" % target)
                        continue
                    resolved = os.path.normpath(os.path.join(md_dir, path))
                    if not os.path.exists(os.path.join(self.root, resolved)):
                        self.problem(where, "link `%s` names no file (resolved to %s)" % (target, resolved))
                        continue
                else:
                    resolved = relative
                if anchor and resolved.endswith(".md"):
                    if anchor not in anchors_of.get(resolved, set()):
                        self.problem(where, "link `%s`: %s has no section with the anchor #%s"
                                     % (target, resolved, anchor))

    # ---- (d) to (g): what the README must document ----------------------------------------------

    def readme_rows(self, readme, section=None):
        """The code spans in the first cell of each table row (of one `## section`, if given)."""
        lines = self.blank_fences(readme).split("\n")
        if section is not None:
            start = next((i for i, l in enumerate(lines) if re.match(r"^##\s+%s\s*$" % re.escape(section), l)), None)
            if start is None:
                return None
            end = next((i for i in range(start + 1, len(lines)) if re.match(r"^##\s", lines[i])), len(lines))
            lines = lines[start + 1:end]
        spans = []
        for line in lines:
            if line.startswith("|"):
                first = line.split("|")[1]
                spans.extend(content for _, content in self.code_spans(first))
        return spans

    def sql_functions(self):
        functions = {}
        attribute = re.compile(r"#\[\s*(?:pgrx::)?pg_(?:extern|trigger)\b(\((?:[^()]|\([^()]*\))*\))?\s*\]")
        for path in sorted(glob.glob(os.path.join(self.root, "src", "**", "*.rs"), recursive=True)):
            relative = os.path.relpath(path, self.root)
            if relative == os.path.join("src", "sql_tests.rs"):
                continue  # #[pg_test]s in a #[pg_schema] mod tests
            with open(path, encoding="utf-8") as handle:
                source = handle.read()
            tests = re.search(r"#\[\s*(?:pgrx::)?pg_schema\s*\]\s*(?:pub\s+)?mod\s+tests\b"
                              r"|#\[cfg\(test\)\]\s*(?:pub\s+)?mod\s+tests\b", source)
            if tests:
                source = source[:tests.start()]
            for match in attribute.finditer(source):
                arguments = match.group(1) or ""
                named = re.search(r"\bname\s*=\s*\"([^\"]+)\"", arguments)
                if named:
                    name = named.group(1)
                else:
                    function = re.compile(r"\bfn\s+([A-Za-z_][A-Za-z0-9_]*)").search(source, match.end())
                    if not function:
                        continue
                    name = function.group(1)
                if not name.startswith("_"):
                    functions.setdefault(name, relative)
        views = {}
        for path in sorted(glob.glob(os.path.join(self.root, "sql", "*.sql"))):
            relative = os.path.relpath(path, self.root)
            with open(path, encoding="utf-8") as handle:
                source = handle.read()
            for kind, name in re.findall(
                    r"\bCREATE\s+(?:OR\s+REPLACE\s+)?(FUNCTION|VIEW)\s+(?:[@\w]+@?\.)?\"?([A-Za-z_][A-Za-z0-9_]*)",
                    source, re.I):
                if kind.upper() == "FUNCTION":
                    functions.setdefault(name, relative)
                elif "meili" in name:
                    views.setdefault(name, relative)
        return functions, views

    def check_readme(self):
        if not os.path.exists(os.path.join(self.root, "README.md")):
            self.problem("README.md", "missing")
            return
        readme = self.read("README.md")
        all_spans = {content for _, content in self.code_spans(self.blank_fences(readme))}
        rows = self.readme_rows(readme)

        functions, views = self.sql_functions()
        if not functions:
            self.problem("src/", "found no #[pg_extern] function: has the attribute changed? Fix check-docs.py")
        self.note("SQL functions: %s" % ", ".join(sorted(functions)))
        self.note("views: %s" % ", ".join(sorted(views)))
        for name in sorted(INTERNAL_FUNCTIONS - set(functions)):
            self.problem("scripts/check-docs.py", "INTERNAL_FUNCTIONS names `%s`, which the extension no longer "
                                                  "defines: take it out (and out of README.md)" % name)
        for name, source in sorted(functions.items()):
            if name in INTERNAL_FUNCTIONS:
                continue
            if not any(span.startswith(name + "(") for span in rows):
                self.problem("README.md", "SQL function `%s` (%s) has no entry: add a row `| `%s(…) → …` | … |` "
                                          "to the SQL reference" % (name, source, name))
        for name, source in sorted(views.items()):
            if name not in all_spans:
                self.problem("README.md", "view `%s` (%s) is not documented: name it in backticks where its "
                                          "columns are described" % (name, source))

        options_source = os.path.join("crates", "core", "src", "options.rs")
        options = []
        if os.path.exists(os.path.join(self.root, options_source)):
            known = re.search(r"KNOWN_OPTIONS\s*:\s*&\[&str\]\s*=\s*&\[(.*?)\];", self.read(options_source), re.S)
            if known:
                options = re.findall(r"\"([^\"]+)\"", known.group(1))
        if not options:
            self.problem(options_source, "found no KNOWN_OPTIONS list of option names: fix check-docs.py")
        self.note("options: %s" % ", ".join(options))
        option_rows = self.readme_rows(readme, "Options")
        if option_rows is None:
            self.problem("README.md", "has no `## Options` section")
        else:
            for name in options:
                if name not in option_rows:
                    self.problem("README.md", "option `%s` (%s) has no row in the Options table"
                                 % (name, options_source))

        gucs_source = os.path.join("src", "gucs.rs")
        gucs = []
        if os.path.exists(os.path.join(self.root, gucs_source)):
            gucs = sorted(set(re.findall(r"c\"(meili_sync\.[a-z_]+)\"", self.read(gucs_source))))
        if not gucs:
            self.problem(gucs_source, "found no c\"meili_sync.<name>\" setting: fix check-docs.py")
        self.note("settings: %s" % ", ".join(gucs))
        for name in gucs:
            if name not in rows:
                self.problem("README.md", "setting `%s` (%s) has no row in the Settings table" % (name, gucs_source))


def main():
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=default_root, help="the repository to check (default: this one)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print what was read")
    arguments = parser.parse_args()
    checker = Checker(arguments.root, arguments.verbose)
    checker.check_markdown()
    checker.check_readme()
    checker.note("checked %(paths)d paths, %(items)d Rust items and %(links)d links" % checker.checked)
    if checker.problems:
        for problem in checker.problems:
            print("check-docs: " + problem, file=sys.stderr)
        print("check-docs: %d problem(s); fix the docs (or, if a check is wrong, scripts/check-docs.py)"
              % len(checker.problems), file=sys.stderr)
        return 1
    print("check-docs: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
