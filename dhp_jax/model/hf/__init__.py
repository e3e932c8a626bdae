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
to check the results.
"""

from dhp_jax.model.hf.api import (FAMILIES, hidden_states, load_config, load_pretrained, logits, parse_config, prepare,
                                  save_pretrained, to_state_dict)
from dhp_jax.model.hf.config import HFConfig
from dhp_jax.model.hf.sample import inputs_from_sample, sample_from_inputs

__all__ = ["FAMILIES", "HFConfig", "hidden_states", "inputs_from_sample", "load_config", "load_pretrained", "logits",
           "parse_config", "prepare", "sample_from_inputs", "save_pretrained", "to_state_dict"]
