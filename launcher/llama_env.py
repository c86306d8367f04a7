"""llama-server's environment on `specd up`: the `LLAMA_ARG_*` variables (and
`LLAMA_API_KEY`) that llama.cpp's server reads, and its container images are configured by,
read as the flags they stand for, before a config file's and the command line's, which win
where they name the same (as llama-server's command line does). A variable for a flag
`specd up` does not take is refused, naming it, as the flag would be."""

from __future__ import annotations

from collections.abc import Mapping

from launcher.config_file import CONFIG_TARGET

# each variable -> the flag of `specd up` it stands for (llama-server's spelling; two
# variables where llama.cpp renamed one)
VALUES = {
    "LLAMA_ARG_MODEL": CONFIG_TARGET,  # the target where the command line names none
    "LLAMA_ARG_HF_REPO": CONFIG_TARGET,
    "LLAMA_ARG_MODEL_DRAFT": "--model-draft",
    "LLAMA_ARG_SPEC_DRAFT_MODEL": "--model-draft",
    "LLAMA_ARG_HFD_REPO": "--hf-repo-draft",
    "LLAMA_ARG_SPEC_DRAFT_HF_REPO": "--hf-repo-draft",
    "LLAMA_ARG_HOST": "--host",
    "LLAMA_ARG_PORT": "--port",
    "LLAMA_API_KEY": "--api-key",
    "LLAMA_ARG_ALIAS": "--alias",
    "LLAMA_ARG_CTX_SIZE": "--ctx-size",
    "LLAMA_ARG_N_PARALLEL": "--parallel",
    "LLAMA_ARG_BATCH": "--batch-size",
    "LLAMA_ARG_UBATCH": "--ubatch-size",
    "LLAMA_ARG_N_PREDICT": "--n-predict",
    "LLAMA_ARG_THREADS": "--threads",
    "LLAMA_ARG_N_GPU_LAYERS": "--n-gpu-layers",
    "LLAMA_ARG_N_GPU_LAYERS_DRAFT": "--n-gpu-layers-draft",
    "LLAMA_ARG_DRAFT_MAX": "--draft-max",
    "LLAMA_ARG_SPEC_TYPE": "--spec-type",
    "LLAMA_ARG_SPEC_DRAFT_N_MAX": "--draft-max",
    "LLAMA_ARG_DRAFT_P_MIN": "--draft-p-min",
    "LLAMA_ARG_SPEC_DRAFT_P_MIN": "--draft-p-min",
    "LLAMA_ARG_SSL_CERT_FILE": "--ssl-cert-file",
    "LLAMA_ARG_SSL_KEY_FILE": "--ssl-key-file",
    "LLAMA_ARG_CHAT_TEMPLATE": "--chat-template",
    "LLAMA_ARG_CHAT_TEMPLATE_FILE": "--chat-template-file",
    "LLAMA_ARG_TEMPERATURE": "--temp",
    "LLAMA_ARG_TOP_K": "--top-k",
    "LLAMA_ARG_TOP_P": "--top-p",
    "LLAMA_ARG_MIN_P": "--min-p",
    "LLAMA_ARG_CACHE_REUSE": "--cache-reuse",
    "LLAMA_ARG_DEFRAG_THOLD": "--defrag-thold",
}
# switches: a true value (on, enabled, true, 1, as llama.cpp reads it) gives the flag, a
# false one (off, disabled, false, 0) leaves it off; each asks for what specd does anyway
SWITCHES = {
    "LLAMA_ARG_JINJA": "--jinja",
    "LLAMA_ARG_CONT_BATCHING": "--cont-batching",
    "LLAMA_ARG_ENDPOINT_METRICS": "--metrics",
}
# said either way: a true value gives --NAME, a false one --no-NAME
TOGGLES = {"LLAMA_ARG_ENDPOINT_SLOTS": "slots"}
# llama-server's web page on or off (its image's default): specd serves none either way
NO_EFFECT = {"LLAMA_ARG_UI", "LLAMA_ARG_NO_UI", "LLAMA_ARG_WEBUI", "LLAMA_ARG_NO_WEBUI"}
TRUE, FALSE = ("on", "enabled", "true", "1"), ("off", "disabled", "false", "0")


def llama_env_flags(environ: Mapping[str, str], error) -> list[str]:
    """The flags `environ`'s llama-server variables stand for, in a fixed order;
    `error(message)` for a variable `specd up` does not take or a switch's value that is
    neither true nor false."""
    out = []
    for name in sorted(environ):
        if not (name.startswith("LLAMA_ARG_") or name == "LLAMA_API_KEY") or name in NO_EFFECT:
            continue
        value = environ[name]
        if name in VALUES:
            out += [VALUES[name], value]
        elif name == "LLAMA_ARG_FLASH_ATTN":  # on, off or auto; older images say 1 or 0
            out += ["--flash-attn", "on" if value in TRUE else "off" if value in FALSE else value]
        elif name in SWITCHES or name in TOGGLES:
            if value not in TRUE + FALSE:
                error(f"{name}={value}: a switch is one of {', '.join(TRUE + FALSE)}")
            if name in TOGGLES:
                out.append(f"--{'' if value in TRUE else 'no-'}{TOGGLES[name]}")
            elif value in TRUE:
                out.append(SWITCHES[name])
        else:
            error(
                f"{name} (llama-server's environment) names a flag specd up does not take; "
                "unset it (see specd up -h for what it takes)"
            )
    return out
