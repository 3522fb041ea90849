#!/usr/bin/env python3
"""Tier 0: the docs name only what exists, and the reference documents every function, view, GUC and option.

Fails (exit 1, one line per problem) when:

  a) a Markdown file of the repository (README.md, ARCHITECTURE.md, CONTRIBUTING.md, docs/**/*.md and
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

  The checks d) to g) read the reference pages, the *.md files directly in docs/reference/. Their
  markup:

     - An ENTRY is a heading of level 2 or 3 whose whole text is one code span holding the name:
           ## `meili_sync_start`        ## `meili_sync_status`        ## `meili_sync.naptime`
       Other headings (`# Task functions`, `### By task`) are not entries.
     - What an entry names depends on its page (PAGE_KINDS): in views.md views, in settings.md
       settings, in options.md task options; README.md is the index and has no entries; every
       other page (task-functions.md, search-functions.md, ...) holds functions. An overloaded
       function (meili_search) has one entry that documents each form.
     - A name has one entry: a second one (on any page, for the same kind) is a problem.

  d) a SQL function of the extension has no entry, or a function page has an entry for a function
     the extension does not define. Functions are the #[pg_extern] and #[pg_trigger] functions in
     src/ (the attribute's name = "..." or the fn's own name; test code is skipped) and the CREATE
     FUNCTION statements in sql/*.sql. INTERNAL_FUNCTIONS lists the ones users are not meant to
     call: they need no entry (an entry for one is allowed, since it exists).
  e) a view of the extension (CREATE VIEW in sql/*.sql) has no entry in views.md, or views.md has an
     entry for a view that does not exist.
  f) a task option (the names of OPTIONS in crates/core/src/task/options.rs, a list of
     `("name", Alter::X)` pairs) has no entry in options.md, or options.md has one for an option
     that does not exist; and the entry of meili_sync_alter does not have, for each Alter group of
     ALTER_GROUPS, exactly one line (in that entry, not elsewhere) of the form
           - **Changed in place:** `batch_size`, `batch_bytes`, ...
           - **Changed in place, by the task's owner only:** `url`, ...
           - **One way only:** `decoding` (an explanation, which may hold code spans of its own)
           - **Need a new task (0A000):** `primary_key`, ...
     whose leading code spans (separated by commas, `and` or `or`; the first thing that is not
     such a span ends the list) are exactly the options OPTIONS puts in that group. An Alter
     variant that ALTER_GROUPS does not know is a problem too.
  g) a setting (every c"meili_sync.<name>" in src/gucs.rs) has no entry in settings.md, or
     settings.md has an entry for a setting that does not exist.
  h) README.md has 5,000 words or more (README_MAX_WORDS), counted as `wc -w` counts them.
  i) ARCHITECTURE.md is a map that cannot drift (MAP_FILE):
     - its folder map (the list items under the heading `## Folders`, each opening with a code
       span that names a folder, `- `src/worker/` — what it holds`) has no line for a folder
       under src/ or crates/core/src/ (MAP_ROOTS, every depth), or for a top-level folder of the
       repository (a line for one of its subfolders will do: `crates/core/src/` covers crates/);
       or a line of it names a folder that does not exist;
     - it names in backticks a path that does not exist relative to the repository root: any
       token with a `/` (not leading) made of path characters, or ending in .rs .sh .py .sql .md
       (STRICT_PATH_EXTENSIONS), `path.rs::item` included. Unlike a), no other base directory is
       tried: the map spells every path in full (`src/worker/stream.rs`, not `worker/stream.rs`).

    python3 scripts/check-docs.py              check this checkout
    python3 scripts/check-docs.py --root DIR   check another tree (say, a copy with a bogus path)
    python3 scripts/check-docs.py -v           also print what was read
    python3 scripts/check-docs.py --self-test  check the checks: the tree as it is must pass, and a
                                               copy of it broken for each check (an entry removed,
                                               an entry for nothing, an alter group line broken, a
                                               long README, a bogus path or anchor, a source folder
                                               missing from the map, a map path not spelled from the
                                               root) must fail
"""

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

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

# Functions of the extension that users are not meant to call, so the reference need not give them
# an entry (docs/reference/README.md names them once, under "Internal functions"):
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

# The reference pages, and what their entries are: in views.md views, in settings.md settings, in
# options.md task options; README.md is the index (no entries); every other page of the folder
# holds functions.
REFERENCE_DIR = "docs/reference"
PAGE_KINDS = {"views.md": "view", "settings.md": "setting", "options.md": "option"}
KIND_WORDS = {"function": "SQL function", "view": "view", "setting": "setting", "option": "task option"}
KIND_PAGES = {"view": REFERENCE_DIR + "/views.md", "setting": REFERENCE_DIR + "/settings.md",
              "option": REFERENCE_DIR + "/options.md"}
KIND_SOURCES = {"function": "#[pg_extern] or #[pg_trigger] in src/, CREATE FUNCTION in sql/*.sql",
                "view": "CREATE VIEW in sql/*.sql", "setting": "src/gucs.rs",
                "option": "OPTIONS in crates/core/src/task/options.rs"}
# An entry: a heading of level 2 or 3 that is one code span holding the name, e.g. ## `meili_sync_start`.
ENTRY = re.compile(r"^#{2,3}[ \t]+`([^`\s]+)`[ \t]*#*[ \t]*$")

OPTIONS_SOURCE = "crates/core/src/task/options.rs"
GUCS_SOURCE = "src/gucs.rs"

# The groups of Alter in OPTIONS, and the label of the line that lists each group's options in the
# entry of ALTER_FUNCTION: `- **<label>:** `name`, `name`, …` (then, optionally, an explanation).
ALTER_FUNCTION = "meili_sync_alter"
ALTER_GROUPS = {
    "InPlace": "Changed in place",
    "ByOwner": "Changed in place, by the task's owner only",
    "OneWay": "One way only",
    "NewTask": "Need a new task (0A000)",
}

# The README is the user's entry, not the manual: fewer words than this, counted as `wc -w` does
# (runs of characters other than ASCII whitespace).
README_MAX_WORDS = 5000
WORD = re.compile(r"[^ \t\n\r\f\v]+")

# The map (check i): the file, the heading of its folder list, the folders whose every subfolder
# needs a line, and the extensions that make a token without `/` a path.
MAP_FILE = "ARCHITECTURE.md"
MAP_HEADING = "Folders"
MAP_ROOTS = ["src", "crates/core/src"]
STRICT_PATH_EXTENSIONS = ("rs", "sh", "py", "sql", "md")
STRICT_PATH = re.compile(r"^(\./)?[A-Za-z0-9_.*@+-]+(/[A-Za-z0-9_.*@+-]+)*/?$")
MAP_LINE = re.compile(r"^[-*][ \t]+`([^`\s]+)`")

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

    # ---- (d) to (h): the reference pages, and the README's length -----------------------------

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

    def options(self):
        """The task options of OPTIONS in crates/core/src/task/options.rs, as (name, Alter variant)."""
        if not os.path.exists(os.path.join(self.root, OPTIONS_SOURCE)):
            self.problem(OPTIONS_SOURCE, "missing: check-docs.py reads the task options from it")
            return []
        source = self.read(OPTIONS_SOURCE)
        table = re.search(r"\bOPTIONS\s*:\s*&\[\s*\(\s*&str\s*,\s*Alter\s*\)\s*\]\s*=\s*&\[(.*?)\];", source, re.S)
        if not table:
            self.problem(OPTIONS_SOURCE, "found no `OPTIONS: &[(&str, Alter)]` list of the task options: "
                                         "has it changed? Fix check-docs.py")
            return []
        body = re.sub(r"//[^\n]*", "", table.group(1))
        options = re.findall(r"\(\s*\"([^\"]+)\"\s*,\s*Alter::([A-Za-z]+)\s*,?\s*\)", body)
        if len(options) != len(re.findall(r"\"[^\"]*\"", body)) or not options:
            self.problem(OPTIONS_SOURCE, "could not read every entry of OPTIONS as `(\"name\", Alter::X)`: "
                                         "fix check-docs.py")
        for name, alter in options:
            if alter not in ALTER_GROUPS:
                self.problem(OPTIONS_SOURCE, "option `%s` is `Alter::%s`, which check-docs.py does not know: "
                                             "add the group to ALTER_GROUPS (and its line to the reference "
                                             "of meili_sync_alter)" % (name, alter))
        return options

    def settings(self):
        if not os.path.exists(os.path.join(self.root, GUCS_SOURCE)):
            self.problem(GUCS_SOURCE, "missing: check-docs.py reads the settings from it")
            return []
        gucs = sorted(set(re.findall(r"c\"(meili_sync\.[a-z_]+)\"", self.read(GUCS_SOURCE))))
        if not gucs:
            self.problem(GUCS_SOURCE, "found no c\"meili_sync.<name>\" setting: fix check-docs.py")
        return gucs

    @staticmethod
    def page_kind(name):
        """What the entries of the reference page `name` (a file name in docs/reference/) are."""
        if name == "README.md":
            return None
        return PAGE_KINDS.get(name, "function")

    def reference_entries(self):
        """{kind: {name: [where, ...]}} of the entry headings of the pages of docs/reference/, and
        {page: [(line number, line)]} of the prose lines of the function pages."""
        entries = {kind: {} for kind in KIND_WORDS}
        function_pages = {}
        directory = os.path.join(self.root, REFERENCE_DIR)
        for name in sorted(os.listdir(directory)):
            kind = self.page_kind(name)
            relative = os.path.join(REFERENCE_DIR, name)
            if not name.endswith(".md") or kind is None:
                continue
            lines = self.blank_fences(self.read(relative)).split("\n")
            if kind == "function":
                function_pages[relative] = list(enumerate(lines, 1))
            for number, line in enumerate(lines, 1):
                entry = ENTRY.match(line)
                if entry:
                    entries[kind].setdefault(entry.group(1), []).append("%s:%d" % (relative, number))
        return entries, function_pages

    @staticmethod
    def leading_names(text):
        """The names in the code spans that open `text`, separated by commas, `and` or `or`: in
        "`decoding` (from `own` to `shared`)", only `decoding`."""
        names, position = [], 0
        separator = r"\s*(?:,\s*)?(?:(?:and|or)\s+)?"
        while True:
            span = re.match((separator if names else r"\s*") + r"`([^`]+)`", text[position:])
            if not span:
                return names
            names.append(span.group(1))
            position += span.end()

    def check_alter_groups(self, options, entries, function_pages):
        """The four lines of meili_sync_alter's entry name exactly the options of each Alter group."""
        homes = entries["function"].get(ALTER_FUNCTION, [])
        if not homes:
            return  # reported as a function without an entry
        home_page, home_line = homes[0].rsplit(":", 1)
        home_line = int(home_line)
        section_end = min([int(where.rsplit(":", 1)[1])
                           for where_list in entries["function"].values() for where in where_list
                           if where.rsplit(":", 1)[0] == home_page and int(where.rsplit(":", 1)[1]) > home_line]
                          + [len(function_pages[home_page]) + 1])
        for alter, label in ALTER_GROUPS.items():
            line = re.compile(r"^- \*\*%s:\*\*\s*(.*)$" % re.escape(label))
            found = [(page, number, line.match(text).group(1))
                     for page, lines in sorted(function_pages.items()) for number, text in lines
                     if line.match(text)]
            inside = [(page, number, rest) for page, number, rest in found
                      if page == home_page and home_line < number < section_end]
            for page, number, _ in found:
                if (page, number) not in [(p, n) for p, n, _ in inside] or len(inside) > 1:
                    self.problem("%s:%d" % (page, number), "a second `- **%s:**` line, or one outside the entry "
                                 "of %s: the options of each group are listed once, there" % (label, ALTER_FUNCTION))
            if not inside:
                self.problem(homes[0], "the entry of %s has no line `- **%s:** `name`, `name`, …` listing the "
                                       "options OPTIONS marks Alter::%s" % (ALTER_FUNCTION, label, alter))
                continue
            page, number, rest = inside[0]
            where = "%s:%d" % (page, number)
            listed = self.leading_names(rest)
            expected = [name for name, group in options if group == alter]
            for name in expected:
                if name not in listed:
                    self.problem(where, "`%s` is Alter::%s in %s, but not on the line `- **%s:**`"
                                 % (name, alter, OPTIONS_SOURCE, label))
            for name in listed:
                if name not in expected:
                    group = dict(options).get(name)
                    self.problem(where, "`%s` is on the line `- **%s:**`, but %s" % (
                        name, label, "is no task option" if group is None
                        else "OPTIONS in %s marks it Alter::%s" % (OPTIONS_SOURCE, group)))
            for name in sorted({name for name in listed if listed.count(name) > 1}):
                self.problem(where, "`%s` is listed twice on the line `- **%s:**`" % (name, label))

    def check_reference(self):
        if not os.path.isdir(os.path.join(self.root, REFERENCE_DIR)):
            self.problem(REFERENCE_DIR + "/", "missing: the reference pages of every function, view, setting "
                                              "and option go there")
            return
        functions, views = self.sql_functions()
        if not functions:
            self.problem("src/", "found no #[pg_extern] function: has the attribute changed? Fix check-docs.py")
        for name in sorted(INTERNAL_FUNCTIONS - set(functions)):
            self.problem("scripts/check-docs.py", "INTERNAL_FUNCTIONS names `%s`, which the extension no longer "
                                                  "defines: take it out (and out of %s/README.md)"
                         % (name, REFERENCE_DIR))
        options = self.options()
        known = {
            "function": {name: source for name, source in functions.items() if name not in INTERNAL_FUNCTIONS},
            "view": views,
            "setting": {name: GUCS_SOURCE for name in self.settings()},
            "option": {name: OPTIONS_SOURCE for name, _ in options},
        }
        exists = dict(known, function=functions)
        entries, function_pages = self.reference_entries()
        for kind, names in known.items():
            self.note("%ss: %s" % (kind, ", ".join(sorted(names))))
            self.note("%s entries: %s" % (kind, ", ".join(sorted(entries[kind]))))
            page = KIND_PAGES.get(kind, "one of the function pages of %s/" % REFERENCE_DIR)
            for name, source in sorted(names.items()):
                if name not in entries[kind]:
                    self.problem(source, "%s `%s` has no entry in the reference: add a heading `## `%s`` to %s"
                                 % (KIND_WORDS[kind], name, name, page))
            for name, where in sorted(entries[kind].items()):
                if name not in exists[kind]:
                    self.problem(where[0], "the entry `%s` names no %s of the extension (%s): rename or remove it"
                                 % (name, KIND_WORDS[kind], KIND_SOURCES[kind]))
                for again in where[1:]:
                    self.problem(again, "a second entry for %s `%s` (the first is %s)"
                                 % (KIND_WORDS[kind], name, where[0]))
        if options:
            self.check_alter_groups(options, entries, function_pages)

    def check_readme_length(self):
        if not os.path.exists(os.path.join(self.root, "README.md")):
            self.problem("README.md", "missing")
            return
        words = len(WORD.findall(self.read("README.md")))
        self.note("README.md: %d words" % words)
        if words >= README_MAX_WORDS:
            self.problem("README.md", "%d words (as `wc -w` counts them), not fewer than %d: the README is the "
                                      "user's entry; move detail to docs/ or docs/reference/"
                         % (words, README_MAX_WORDS))

    # ---- (i): the map --------------------------------------------------------------------------

    def map_lines(self, text):
        """(line number, folder) of each item of the map's folder list."""
        found, inside = [], False
        for number, line in enumerate(self.blank_fences(text).split("\n"), 1):
            heading = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
            if heading:
                inside = heading.group(1) == "##" and heading.group(2) == MAP_HEADING
                continue
            entry = MAP_LINE.match(line) if inside else None
            if entry:
                found.append((number, entry.group(1)))
        return found

    def folders_needing_a_line(self):
        """Every folder under MAP_ROOTS (the roots too), as `a/b/`."""
        needed = []
        for top in MAP_ROOTS:
            for directory, subdirs, _ in os.walk(os.path.join(self.root, top)):
                subdirs[:] = sorted(d for d in subdirs if d not in SKIP_DIRS)
                needed.append(os.path.relpath(directory, self.root).replace(os.sep, "/") + "/")
        return needed

    @staticmethod
    def strict_path(token):
        """The path a code span of the map names (`path.rs::item` gives `path.rs`), or None."""
        with_item = PATH_AND_ITEM.match(token)
        if with_item:
            token = with_item.group("path")
        if not STRICT_PATH.match(token):
            return None
        if "/" in token.rstrip("/") or token.endswith("/"):
            return token
        if token.rsplit(".", 1)[-1] in STRICT_PATH_EXTENSIONS and "." in token:
            return token
        return None

    def check_map(self):
        if not os.path.exists(os.path.join(self.root, MAP_FILE)):
            self.problem(MAP_FILE, "missing: the map of the folders and the rules of every change")
            return
        text = self.read(MAP_FILE)
        lines = self.map_lines(text)
        self.note("%s: %d folder lines" % (MAP_FILE, len(lines)))
        if not lines:
            self.problem(MAP_FILE, "no folder map: a heading `## %s` followed by one list item per folder, "
                                   "each opening with the folder in backticks" % MAP_HEADING)
        mapped = set()
        for number, folder in lines:
            name = folder if folder.endswith("/") else folder + "/"
            mapped.add(name)
            if not os.path.isdir(os.path.join(self.root, name)):
                self.problem("%s:%d" % (MAP_FILE, number), "the folder map has a line for `%s`, which names "
                             "no folder of the repository (spelled from its root)" % folder)
        for folder in self.folders_needing_a_line():
            if folder not in mapped:
                self.problem(MAP_FILE, "`%s` has no line in the folder map (`## %s`): add `- `%s` — what it "
                                       "holds`" % (folder, MAP_HEADING, folder))
        for top in sorted(self.top_dirs):
            if top.startswith("."):
                continue
            if not any(name == top + "/" or name.startswith(top + "/") for name in mapped):
                self.problem(MAP_FILE, "the top-level folder `%s/` has no line in the folder map (`## %s`), "
                                       "nor does any folder under it" % (top, MAP_HEADING))
        for line, token in self.code_spans(self.blank_fences(text)):
            path = self.strict_path(token)
            if path is None:
                continue
            self.checked["paths"] += 1
            candidate = os.path.normpath(os.path.join(self.root, path))
            exists = (glob.glob(candidate) if "*" in path
                      else os.path.isdir(candidate) if path.endswith("/") else os.path.exists(candidate))
            if not candidate.startswith(self.root) or not exists:
                self.problem("%s:%d" % (MAP_FILE, line), "`%s` names no file or folder relative to the "
                             "repository root: the map spells every path in full" % path)

    def run(self):
        self.check_markdown()
        self.check_reference()
        self.check_readme_length()
        self.check_map()
        self.note("checked %(paths)d paths, %(items)d Rust items and %(links)d links" % self.checked)
        return self.problems


# ---- --self-test: each check fails on a tree broken for it ------------------------------------

def replace_in(path, old, new, count=1):
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    if old not in text:
        raise AssertionError("%s does not contain %r" % (path, old))
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(text.replace(old, new, count))


def append_to(path, text):
    with open(path, "a", encoding="utf-8") as handle:
        handle.write(text)


def alter_line(root, label):
    """The path of the function page holding the line `- **label:**`, and that line."""
    directory = os.path.join(root, REFERENCE_DIR)
    for name in sorted(os.listdir(directory)):
        path = os.path.join(directory, name)
        if Checker.page_kind(name) == "function" and name.endswith(".md"):
            with open(path, encoding="utf-8") as handle:
                for line in handle.read().split("\n"):
                    if line.startswith("- **%s:**" % label):
                        return path, line
    raise AssertionError("no line `- **%s:**` under %s" % (label, REFERENCE_DIR))


def self_test_cases():
    """(what is broken, how, a piece of the problem it must cause)."""
    ref = lambda root, name: os.path.join(root, REFERENCE_DIR, name)

    def drop_entry(page, name):
        return lambda root: replace_in(ref(root, page), "## `%s`\n" % name, "## %s, no longer an entry\n" % name)

    def break_line(label, old, new):
        def edit(root):
            path, line = alter_line(root, label)
            replace_in(path, line, line.replace(old, new, 1))
        return edit

    def new_source_folder(root):
        os.makedirs(os.path.join(root, "src", "bogus_folder"))
        append_to(os.path.join(root, "src", "bogus_folder", "mod.rs"), "//! Nothing.\n")

    def long_readme(root):
        append_to(os.path.join(root, "README.md"), "\n" + "word " * README_MAX_WORDS + "\n")

    return [
        ("a function without an entry", drop_entry("task-functions.md", "meili_sync_pause"),
         "SQL function `meili_sync_pause`"),
        ("an entry for a function that does not exist",
         lambda root: append_to(ref(root, "task-functions.md"), "\n## `meili_sync_bogus`\n\nNothing.\n"),
         "the entry `meili_sync_bogus` names no SQL function"),
        ("a function with two entries",
         lambda root: append_to(ref(root, "maintenance-functions.md"), "\n## `meili_sync_stop`\n\nAgain.\n"),
         "a second entry for SQL function `meili_sync_stop`"),
        ("a view without an entry", drop_entry("views.md", "meili_sync_waits"), "view `meili_sync_waits`"),
        ("an entry for a view that does not exist",
         lambda root: append_to(ref(root, "views.md"), "\n## `meili_sync_bogus_view`\n"),
         "the entry `meili_sync_bogus_view` names no view"),
        ("a setting without an entry", drop_entry("settings.md", "meili_sync.naptime"),
         "setting `meili_sync.naptime`"),
        ("an entry for a setting that does not exist",
         lambda root: append_to(ref(root, "settings.md"), "\n## `meili_sync.bogus`\n"),
         "the entry `meili_sync.bogus` names no setting"),
        ("an option without an entry", drop_entry("options.md", "gzip"), "task option `gzip`"),
        ("an entry for an option that does not exist",
         lambda root: append_to(ref(root, "options.md"), "\n## `bogus_option`\n"),
         "the entry `bogus_option` names no task option"),
        ("an option left out of its alter group", break_line("Changed in place", "`gzip`, ", ""),
         "`gzip` is Alter::InPlace"),
        ("an option in the wrong alter group",
         break_line("Need a new task (0A000)", "`primary_key`", "`primary_key`, `decoding`"),
         "`decoding` is on the line `- **Need a new task (0A000):**`, but OPTIONS"),
        ("an alter group line missing", break_line("One way only", "- **One way only:**", "- One way only:"),
         "has no line `- **One way only:**"),
        ("an option the code adds without docs",
         lambda root: replace_in(os.path.join(root, OPTIONS_SOURCE), '("gzip", Alter::InPlace),',
                                 '("gzip", Alter::InPlace),\n    ("bogus_new", Alter::InPlace),'),
         "task option `bogus_new`"),
        ("a README of 5,000 words", long_readme, "not fewer than %d" % README_MAX_WORDS),
        ("a path that does not exist in a reference page",
         lambda root: append_to(ref(root, "README.md"), "\nSee `src/api/bogus.rs`.\n"),
         "`src/api/bogus.rs` names no file"),
        ("a source folder without a line in the map", new_source_folder, "`src/bogus_folder/` has no line"),
        ("a core folder without a line in the map",
         lambda root: replace_in(os.path.join(root, MAP_FILE), "- `crates/core/src/wal/`", "- wal:"),
         "`crates/core/src/wal/` has no line"),
        ("a map line for a folder that does not exist",
         lambda root: replace_in(os.path.join(root, MAP_FILE), "- `docker/`", "- `dockers/`"),
         "has a line for `dockers/`"),
        ("a top-level folder without a line in the map",
         lambda root: os.makedirs(os.path.join(root, "bogus_top")), "`bogus_top/` has no line"),
        ("a map path spelled from a search directory",
         lambda root: append_to(os.path.join(root, MAP_FILE), "\nSee `worker/stream.rs`.\n"),
         "`worker/stream.rs` names no file or folder relative to the repository root"),
        ("a map path without a slash that does not exist",
         lambda root: append_to(os.path.join(root, MAP_FILE), "\nSee `stream.rs::Streamer`.\n"),
         "`stream.rs` names no file or folder relative to the repository root"),
        ("a link to a section that does not exist",
         lambda root: append_to(ref(root, "README.md"), "\nSee [x](views.md#bogus-section).\n"),
         "has no section with the anchor #bogus-section"),
    ]


def self_test(root):
    """Runs the checker on a copy of `root` as it is (which must pass), then on a copy broken for
    each check (each must fail, with the expected problem). Returns the number of failures."""
    ignore = shutil.ignore_patterns(*SKIP_DIRS)
    failures = 0
    with tempfile.TemporaryDirectory(prefix="check-docs-self-test.") as scratch:
        clean = os.path.join(scratch, "clean")
        shutil.copytree(root, clean, ignore=ignore)
        problems = Checker(clean, False).run()
        if problems:
            print("self-test: the tree as it is fails, so the broken copies prove nothing:", file=sys.stderr)
            for problem in problems:
                print("  " + problem, file=sys.stderr)
            return 1
        print("self-test: the tree as it is: ok")
        for number, (what, breaking, expected) in enumerate(self_test_cases()):
            copy = os.path.join(scratch, "case%d" % number)
            shutil.copytree(clean, copy)
            breaking(copy)
            problems = Checker(copy, False).run()
            hits = [problem for problem in problems if expected in problem]
            if hits:
                print("self-test: %s: fails as it should: %s" % (what, hits[0]))
            else:
                failures += 1
                print("self-test: %s: NOT caught (expected a problem with %r; got %s)"
                      % (what, expected, problems or "none"), file=sys.stderr)
            shutil.rmtree(copy)
    return failures


def main():
    default_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--root", default=default_root, help="the repository to check (default: this one)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print what was read")
    parser.add_argument("--self-test", action="store_true",
                        help="check that each check fails on a copy of the tree broken for it")
    arguments = parser.parse_args()
    if arguments.self_test:
        failures = self_test(os.path.abspath(arguments.root))
        if failures:
            print("self-test: %d check(s) did not fail on a broken tree: fix check-docs.py" % failures,
                  file=sys.stderr)
            return 1
        print("self-test: ok")
        return 0
    checker = Checker(arguments.root, arguments.verbose)
    problems = checker.run()
    if problems:
        for problem in problems:
            print("check-docs: " + problem, file=sys.stderr)
        print("check-docs: %d problem(s); fix the docs (or, if a check is wrong, scripts/check-docs.py)"
              % len(problems), file=sys.stderr)
        return 1
    print("check-docs: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
