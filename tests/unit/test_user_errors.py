"""What a user gets wrong, said in one line by every command, never a traceback: a model
name, folder or file that names nothing specd can load (the hub's validator used to raise
on a mistyped path), and a port something else listens on."""

import socket
import subprocess
import sys

import pytest

from launcher.cli import main
from launcher.processes import free_port
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
    # ports of its own: `specd up` says a port in use first, and the services' tests may
    # hold the default ones meanwhile
    flags = ["--http-port", "0"]
    for flag in ("--router-port", "--verifier-port", "--drafter-port"):
        flags += [flag, str(free_port())]
    assert main(["up", "--target", "/nonexistent/folder", *flags]) == 2
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
    assert router.stderr.endswith(
        "specd serve router: /nonexistent/x: no such folder or .gguf file\n"
    )


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from tests.cluster import save_tiny_cluster_model

    return save_tiny_cluster_model(tmp_path_factory.mktemp("tiny-tokenizer"))


def test_a_port_in_use_is_said_so_whichever_listener_it_is(tokenizer):
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        held = str(other.getsockname()[1])
        for flags, what in [
            (("--port", held), ""),
            (("--port", "0", "--http-port", held), " (HTTP)"),
        ]:
            argv = ["serve", "router", "--tokenizer", str(tokenizer), *flags]
            out = subprocess.run(
                [sys.executable, "-m", "launcher", *argv],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
            said = f"specd serve router: cannot listen on 127.0.0.1:{held}{what}: in use"
            assert out.stderr.splitlines()[-1].startswith(said)


@pytest.mark.parametrize(
    "bench",
    [
        ["parity", "--workloads", "code"],
        # the first client's error ends the sweep's task group: its one error
        ["sweep", "--concurrency", "2", "--modes", "off", "--requests-per-cell", "2"],
    ],
)
def test_a_bench_whose_target_cannot_be_reached_says_so(capsys, tmp_path, bench):
    nobody = f"127.0.0.1:{free_port()}"
    out = ["--out", str(tmp_path)] if bench[0] == "sweep" else []
    assert main(["bench", *bench, "--target", nobody, *out]) == 2
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith("specd bench: UNAVAILABLE: ") and said.count("UNAVAILABLE") == 1


def test_the_doors_bench_says_an_http_door_it_cannot_reach():
    door = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as said:
        main(["bench", "doors", "--target", f"127.0.0.1:{free_port()}", "--http", door])
    assert str(said.value).startswith(f"specd bench doors: cannot reach {door}: ")
