"""`python -m specd.models.fetch NAME`, which `make` runs before the virtualenv holds more
than pip: one model's GGUF file, downloaded once, with the standard library alone."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import specd.models.fetch as fetch
from specd.models.catalog import CATALOG, DEFAULT_DRAFT

# in a child process: every import outside the standard library and specd fails
_STDLIB_ONLY = """
import importlib.abc, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        top = name.split(".")[0]
        if top not in sys.stdlib_module_names and top != "specd":
            raise ImportError(f"{name} is not in the standard library")
sys.meta_path.insert(0, Refuse())
from specd.models.fetch import main
sys.exit(main(sys.argv[1:]))
"""


def test_it_runs_on_the_standard_library_alone(tmp_path):
    folder = tmp_path / "models" / DEFAULT_DRAFT
    folder.mkdir(parents=True)
    (folder / ".specd-complete").write_text("x\n")
    root = Path(fetch.__file__).parents[2]
    env = {"SPECD_CACHE": str(tmp_path), "PATH": "/usr/bin:/bin"}
    cmd = [sys.executable, "-I", "-c", _STDLIB_ONLY, "default-draft"]
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(folder)  # converted already: nothing to download


def test_one_download_then_the_file_then_the_converted_folder(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SPECD_CACHE", str(tmp_path))
    downloads = []

    def download(spec, out):
        downloads.append(spec.name)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(b"GGUF")

    monkeypatch.setattr(fetch, "_download_and_assemble", download)
    gguf = tmp_path / "gguf" / CATALOG[DEFAULT_DRAFT].gguf_name
    assert fetch.main(["default-draft"]) == 0
    assert fetch.main([DEFAULT_DRAFT]) == 0
    assert downloads == [DEFAULT_DRAFT]
    folder = tmp_path / "models" / DEFAULT_DRAFT
    folder.mkdir(parents=True)
    (folder / ".specd-complete").write_text("x\n")
    gguf.unlink()
    assert fetch.main(["default-draft"]) == 0
    assert downloads == [DEFAULT_DRAFT]
    assert capsys.readouterr().out.split() == [str(gguf), str(gguf), str(folder)]


def test_a_name_it_does_not_know_is_refused(capsys):
    assert fetch.main(["llama-7b"]) == 2
    assert "usage" in capsys.readouterr().err
