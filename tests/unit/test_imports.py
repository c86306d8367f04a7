"""The import rules, checked on the source: protos <- specd <- services <-
launcher, the three services siblings that never import each other, and a router that
needs no torch."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("drafter_service", "verifier_service", "router")
LAYERS = ("protos", "specd", *SERVICES, "launcher")


def imported(path: Path) -> set[str]:
    """Top-level packages `path` imports, anywhere in the file (function bodies too)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


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
