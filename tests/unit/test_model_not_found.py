"""A model name, folder or file that names nothing specd can load: one clear line from
every command, never a traceback (the hub's validator used to raise on a mistyped path)."""

import subprocess
import sys

import pytest

from launcher.cli import main
from specd.models.resolve import ModelNotFound, resolve


@pytest.mark.parametrize("spec", ["/nonexistent/folder", "./nope", "missing.gguf", "a/b/c"])
def test_a_path_that_is_not_there_is_said_so(spec):
    with pytest.raises(ModelNotFound) as err:
        resolve(spec)
    assert str(err.value) == f"{spec}: no such folder or .gguf file"


def test_a_file_that_is_no_model_is_said_so(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelNotFound, match="a file, neither a Hugging Face folder nor a .gguf"):
        resolve(path)


def test_a_hub_id_the_hub_does_not_give_names_the_catalogue_and_the_hubs_reason(monkeypatch):
    import huggingface_hub

    def offline(name, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(ModelNotFound) as err:
        resolve("someorg/somemodel")
    said = str(err.value)
    assert said.startswith("someorg/somemodel: not a catalogue name (default-draft, ")
    assert said.endswith("did not give it (OSError: no network)")


def test_the_commands_say_it_in_one_line(capsys):
    assert main(["up", "--target", "/nonexistent/folder", "--http-port", "0"]) == 2
    assert (
        capsys.readouterr().err == "specd up: /nonexistent/folder: no such folder or .gguf file\n"
    )
    router = subprocess.run(
        [sys.executable, "-m", "launcher", "serve", "router", "--tokenizer", "/nonexistent/x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert router.returncode == 2 and "Traceback" not in router.stderr
    assert router.stderr.endswith("specd serve: /nonexistent/x: no such folder or .gguf file\n")
