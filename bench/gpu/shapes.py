"""Real models' shapes with random weights, built on the device: a transformers model from
the shape's config, and specd's model from the same tensors through the loader's path.

The weights are transformers' initialisation (normal, std 0.02): logits near uniform, so
token agreement between two models says nothing; speed and exactness do."""

from __future__ import annotations

import tempfile
import time

import torch

LLAMA3_ROPE = dict(
    rope_type="llama3", rope_theta=500000.0, factor=32.0, low_freq_factor=1.0,
    high_freq_factor=4.0, original_max_position_embeddings=8192,
)  # fmt: skip
SHAPES = {  # the configs' shape fields, as their model cards publish them
    "qwen2.5-1.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
        num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "qwen2.5-0.5b": dict(
        model_type="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
        max_position_embeddings=32768, rms_norm_eps=1e-6, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
    ),
    "llama-3.2-3b": dict(
        model_type="llama", vocab_size=128256, hidden_size=3072, intermediate_size=8192,
        num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8, head_dim=128,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
    ),
    "llama-3.2-1b": dict(
        model_type="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192,
        num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8, head_dim=64,
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_parameters=LLAMA3_ROPE,
    ),
    "tiny": dict(  # for a smoke run of the harness on a CPU
        model_type="llama", vocab_size=96, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}  # fmt: skip


class StateDict:
    """A transformers model's tensors by the loader's names (specd.models.loader's
    DenseTensors interface), shared, not copied."""

    def __init__(self, hf):
        self.tensors = {k.removeprefix("model."): v for k, v in hf.state_dict().items()}

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def __call__(self, name: str) -> torch.Tensor:
        return self.tensors[name]


def build(
    shape: str, device: str, dtype: torch.dtype, seed: int = 0, draft: bool = False, **fields
):
    """(transformers model, specd model) of `shape` with the same random weights; `draft`:
    specd's prepared as a drafter's (specd.models.loader's `draft_vocab`); `fields`
    override the shape's config (e.g. num_hidden_layers=1)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from specd.models.loader import load_model

    fields = SHAPES[shape] | fields
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=dtype).eval()
    draft_vocab = 0 if draft else None  # the whole head: random weights have no frequencies
    with tempfile.TemporaryDirectory(prefix=f"specd-{shape}-") as folder:  # its config only
        config.save_pretrained(folder)
        ours = load_model(
            folder, dtype=dtype, device=device, dense=StateDict(hf), draft_vocab=draft_vocab
        )
    return hf, ours


def bytes_per_token(model) -> int:
    """What one decode step reads of the weights: every layer, the final norm, the head
    (an embedding row is noise beside them)."""
    tensors = [model.norm, model.lm_head]
    for layer in model.layers:
        tensors += [t for t in vars(layer).values() if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


def emulated(model, seconds: float, queued: bool = False):
    """`model`, each forward taking `seconds` more (asleep, the GIL released): on a CPU, the
    tiny shape at a GPU step's pace, so that the Python around the steps (the speculation
    control's, the services') weighs as beside a GPU's step. A GPU runs at its own.

    `queued`: as a GPU's forward, it returns once computed and its `seconds` pass from
    then on, until `synchronize` (the verifier's target: `LlamaModel.queued`); else it
    sleeps first (a drafter reads each forward's logits at once)."""
    if seconds <= 0:
        return model
    forward = model.forward
    if not queued:

        def slowed(*args, **kwargs):
            time.sleep(seconds)
            return forward(*args, **kwargs)

        model.forward = slowed
        return model
    done = [0.0]  # when the device would have run what was queued

    def queue(*args, **kwargs):
        out = forward(*args, **kwargs)
        done[0] = time.perf_counter() + seconds
        return out

    def synchronize():
        time.sleep(max(0.0, done[0] - time.perf_counter()))

    model.forward, model.synchronize, model.queued = queue, synchronize, True
    return model
