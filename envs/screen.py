"""Static screen of a candidate's changed Python code for ways to reach the test runner's verdict.

The second line of defence behind the grader's canaries (envs/grade_runner.py): code under test
runs in the same interpreter as pytest, so a fix that brings in pytest/pluggy/`__main__`
internals, the import machinery (`sys.modules`, `sys.meta_path`, `builtins`, `__import__`),
frame or object-graph walking (`sys._getframe`, `f_back`, `gc`, `inspect`), `/proc` or raw file
descriptor writes, `ctypes`, tracing hooks or process exits is not graded. Only constructs the
edit INTRODUCES count (old source vs new source), so a repository that already uses one of them
is not penalised for keeping it. Tokens come from the AST (names, attributes, imports, string
constants), so spacing, comments or line breaks do not hide them.

Stdlib only: envs/pool.py and envs/batch_grading.py send this file's source into grader
containers ahead of their runners. Not here: the patch path policy (envs/patches.py).
"""

import ast

# rule -> tokens. Tokens: "import:<top module>", "attr:<name>", "mod:<os|sys>.<name>", "name:<id>",
# "call:<fn>" (getattr & co. with a computed name), "str:<needle>" (inside any string constant).
SCREEN_RULES = {
    "test runner internals": {"import:pytest", "import:_pytest", "import:pluggy", "import:__main__",
                              "name:__main__", "str:__main__", "str:_pytest", "str:pluggy", "attr:hookimpl",
                              "attr:pluginmanager", "str:pytest", "import:unittest", "attr:mock"},
    "import machinery": {"mod:sys.modules", "attr:meta_path", "attr:path_hooks", "attr:path_importer_cache",
                         "import:importlib", "import:imp", "import:zipimport", "import:runpy", "import:pkgutil",
                         "name:__import__", "import:builtins", "name:__builtins__", "attr:__builtins__",
                         "str:builtins", "str:meta_path", "attr:__import__", "attr:__self__", "attr:__loader__",
                         "attr:__spec__"},
    "frame or object-graph walking": {"attr:_getframe", "mod:sys.exc_info", "attr:f_back", "attr:f_locals",
                                      "attr:f_globals",
                                      "attr:f_code", "attr:f_trace", "attr:tb_frame", "attr:tb_next", "attr:gi_frame",
                                      "attr:cr_frame", "attr:ag_frame", "attr:__traceback__", "import:inspect",
                                      "import:gc", "attr:__subclasses__", "attr:__bases__",
                                      "attr:__mro__", "attr:__globals__", "attr:__closure__", "attr:__code__",
                                      "attr:__dict__", "name:globals", "name:locals",
                                      "str:_getframe", "str:f_back", "str:f_locals"},
    "dynamic code": {"name:exec", "name:eval", "name:compile", "call:getattr", "call:setattr", "call:delattr",
                     "attr:CodeType", "attr:FunctionType", "import:marshal", "import:pickle", "import:code",
                     "import:codeop", "attr:attrgetter", "attr:methodcaller", "name:getattr", "name:setattr"},
    "/proc, /dev or raw file descriptors": {"str:/proc", "str:/dev/", "str:/sys/", "mod:os.dup", "mod:os.dup2",
                                            "attr:fdopen", "mod:os.pipe", "attr:openpty", "mod:os.write",
                                            "mod:os.open", "mod:os.read", "mod:os.writev", "mod:os.sendfile",
                                            "mod:sys.__stdout__", "mod:sys.__stderr__", "attr:FileIO",
                                            "import:fcntl", "import:pty", "import:mmap"},
    "native code": {"import:ctypes", "import:_ctypes", "import:cffi", "str:ctypes"},
    "tracing or audit hooks": {"attr:settrace", "attr:setprofile", "attr:addaudithook", "attr:monitoring",
                               "attr:excepthook", "attr:displayhook", "import:atexit", "import:faulthandler"},
    "process control": {"attr:_exit", "mod:os.fork", "attr:forkpty", "mod:os.kill", "mod:os.killpg",
                        "mod:os.abort", "attr:execv", "attr:execve", "attr:execvp", "mod:os.system", "mod:os.popen",
                        "attr:spawnv", "attr:posix_spawn", "mod:sys.exit", "import:subprocess",
                        "import:multiprocessing", "import:signal", "import:_thread", "import:posix",
                        "name:exit", "name:quit"},
}
_STR_NEEDLES = sorted({t[4:] for ts in SCREEN_RULES.values() for t in ts if t.startswith("str:")})
# Modules whose attributes are screened by qualified name ("mod:os.write"): the bare names are
# too common elsewhere (file.write, self.modules).
_QUALIFIED = {"os": "os", "posix": "os", "nt": "os", "sys": "sys"}


def source_tokens(source: str) -> set[str]:
    """Screen tokens of a module's source; empty for code that does not parse (it cannot be
    imported either, so it reaches nothing)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    tokens: set[str] = set()
    aliases = dict(_QUALIFIED)  # local name -> screened module
    # getattr & co. called with a literal name are plain attribute access; passed around as values
    # (functools.reduce(getattr, ...)) or called with a computed name they are not.
    called = {id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
              and n.func.id in ("getattr", "setattr", "delattr")}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                tokens.add("import:" + a.name.split(".")[0])
                if a.name in _QUALIFIED:
                    aliases[a.asname or a.name] = _QUALIFIED[a.name]
        elif isinstance(node, ast.ImportFrom):
            mod = (node.module or "").split(".")[0]
            tokens.add("import:" + mod)
            for a in node.names:
                tokens.add("attr:" + a.name)
                if mod in _QUALIFIED:
                    tokens.add(f"mod:{_QUALIFIED[mod]}.{a.name}")
        elif isinstance(node, ast.Attribute):
            tokens.add("attr:" + node.attr)
            if isinstance(node.value, ast.Name) and node.value.id in aliases:
                tokens.add(f"mod:{aliases[node.value.id]}.{node.attr}")
        elif isinstance(node, ast.Name) and id(node) not in called:
            tokens.add("name:" + node.id)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            text = node.value if isinstance(node.value, str) else node.value.decode("latin-1")
            tokens.update("str:" + n for n in _STR_NEEDLES if n in text)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "setattr", "delattr"):
            if len(node.args) < 2 or not isinstance(node.args[1], ast.Constant):
                tokens.add("call:" + node.func.id)
            else:
                tokens.add("attr:" + str(node.args[1].value))
    return tokens


def screen_source(old: str, new: str) -> list[str]:
    """'rule (token, ...)' for every rule whose tokens the edit old -> new introduces."""
    added = source_tokens(new) - source_tokens(old)
    hits = []
    for rule, tokens in SCREEN_RULES.items():
        found = sorted(t.split(":", 1)[1] for t in added & tokens)
        if found:
            hits.append(f"{rule} ({', '.join(found)})")
    return hits
