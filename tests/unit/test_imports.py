"""The import rules, checked on the source: protos <- specd <- services <-
launcher, the three services siblings that never import each other, no two modules that
import each other, and a router that needs no torch."""

import ast
import subprocess
import sys
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("drafter_service", "verifier_service", "router")
LAYERS = ("protos", "specd", *SERVICES, "launcher")


def imports(path: Path) -> list[tuple[str, list[str]]]:
    """What `path` imports, anywhere in the file (function bodies too): (module, the names
    taken from it; [] for `import module`)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.extend((a.name, []) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.module, [a.name for a in node.names]))
    return out


def imported(path: Path) -> set[str]:
    """Top-level packages `path` imports."""
    return {module.split(".")[0] for module, _ in imports(path)}


def arrows(root: Path = ROOT) -> list[str]:
    wrong = []
    for package in LAYERS:
        allowed = {
            "protos": set(),
            "specd": {"protos"},
            "launcher": {"protos", "specd", *SERVICES},
        }.get(package, {"protos", "specd", package})
        for path in sorted((root / package).rglob("*.py")):
            for target in (imported(path) & set(LAYERS)) - allowed - {package}:
                wrong.append(f"{path.relative_to(root)} imports {target}")
    return wrong


def test_imports_go_one_way_and_services_are_siblings():
    assert arrows() == []


def test_the_check_sees_a_wrong_arrow(tmp_path):
    for package, source in {
        "router": "def f():\n    from verifier_service.engine import Engine\n",
        "specd": "import router.client\n",
        "protos": "from specd import wire\n",
        "drafter_service": "from specd.params import SamplingParams\n",  # allowed
        "verifier_service": "def f():\n    from launcher.cli import main\n",
        "launcher": "import router.server, verifier_service.engine\n",  # allowed
    }.items():
        (tmp_path / package).mkdir()
        (tmp_path / package / "probe.py").write_text(source)
    assert arrows(tmp_path) == [
        "protos/probe.py imports specd",
        "specd/probe.py imports router",
        "verifier_service/probe.py imports launcher",
        "router/probe.py imports verifier_service",
    ]


def module_arrows(root: Path = ROOT) -> dict[str, set[str]]:
    """The project's modules, each with those of them it imports (function bodies too)."""
    paths = [p for package in (*LAYERS, "bench") for p in sorted((root / package).rglob("*.py"))]
    names = {p: ".".join(p.relative_to(root).with_suffix("").parts) for p in paths}
    names = {p: n.removesuffix(".__init__") for p, n in names.items()}
    known = set(names.values())
    out = {}
    for path, name in names.items():
        targets = set()
        for module, taken in imports(path):
            # the module (a package's __init__.py), and a module named from a package
            targets.update([module, *(f"{module}.{n}" for n in taken)])
        out[name] = (targets & known) - {name}
    return out


def circle(root: Path = ROOT) -> list[str]:
    try:
        TopologicalSorter(module_arrows(root)).prepare()
    except CycleError as err:
        return err.args[1]
    return []


def test_no_two_modules_import_each_other():
    """A lazy import inside a function counts: a circle of modules is one module's code
    in two files, whoever imports first."""
    assert circle() == []


def test_the_check_sees_a_circle_through_a_lazy_import(tmp_path):
    (tmp_path / "specd" / "models").mkdir(parents=True)
    (tmp_path / "specd" / "models" / "a.py").write_text("from specd.models.b import f\n")
    (tmp_path / "specd" / "models" / "b.py").write_text(
        "def f():\n    from specd.models import a\n"
    )
    (tmp_path / "specd" / "c.py").write_text("import specd.models.a\n")
    assert sorted(set(circle(tmp_path))) == ["specd.models.a", "specd.models.b"]


def test_the_router_modules_do_not_load_torch():
    """Its request path, both doors and its client: torch stays out of the router's own
    code (its tokenizer library, transformers, still loads it)."""
    code = (
        "import sys, router.server, router.openai_http, router.client, router.generation\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
