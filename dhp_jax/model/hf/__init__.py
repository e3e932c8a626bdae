"""Real model families from Hugging Face checkpoints, in JAX: Qwen2.5-VL, Qwen3-VL and InternVL
(the transformers-native `-hf` layout), exactly as transformers defines them.

    from dhp_jax.model import hf
    config, params = hf.load_pretrained(path, dtype="float32")   # a dir written by save_pretrained
    logits = hf.logits(config, params, inputs)                   # float32 [L, vocab], one sample
    sd = hf.to_state_dict(config, tree)                          # {transformers name: array}
    hf.save_pretrained(config, params, out_dir)                  # transformers' from_pretrained loads it
    sample = hf.sample_from_inputs(config, inputs, labels)       # a dhp_jax.data.Sample with payload

`inputs` is one sample as the family's transformers processor emits it (batch size 1, every key).
Checkpoints are read with numpy alone (memory-mapped safetensors); transformers is only needed
to check the results. Names are imported on first use: `families`, `config`, `spec`, `packed`,
`checkpoint` and `safetensors_io` need no jax (the torch backend `npu_backend.hf` uses them).
"""

from dhp_jax._lazy import lazy_attributes

# public name -> its module, imported on first use (the config and packing modules are NumPy only,
# so the torch backend imports them without jax)
_LAZY = {
    "hidden_states": "dhp_jax.model.hf.api",
    "load_config": "dhp_jax.model.hf.api",
    "load_pretrained": "dhp_jax.model.hf.api",
    "logits": "dhp_jax.model.hf.api",
    "prepare": "dhp_jax.model.hf.api",
    "save_pretrained": "dhp_jax.model.hf.api",
    "to_state_dict": "dhp_jax.model.hf.api",
    "FAMILIES": "dhp_jax.model.hf.families",
    "parse_config": "dhp_jax.model.hf.families",
    "HFConfig": "dhp_jax.model.hf.config",
    "inputs_from_sample": "dhp_jax.model.hf.sample",
    "sample_from_inputs": "dhp_jax.model.hf.sample",
}
__getattr__, __dir__ = lazy_attributes(__name__, _LAZY)
__all__ = sorted(_LAZY)
