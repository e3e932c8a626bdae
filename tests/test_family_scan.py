"""The families' block stacks run as one `lax.scan` each (`dhp_jax.model.hf.scan`): a family group
program (forward and VJP, lowered with abstract params, nothing compiled) has as many ops with
twice the LLM layers and encoder blocks. Qwen2.5-VL's window and full-attention blocks and
Qwen3-VL's DeepStack (encoder taps, LLM feed) are inside the scan. Values against transformers:
tests/test_hf_engine_*.py."""

import re

import pytest


def program_ops(family: str, depth: int) -> int:
    import jax

    from dhp_jax.model.hf.abstract import abstract_params
    from dhp_jax.model.hf.api import parse_config
    from dhp_jax.sharding.executor import PlanExecutor
    from dhp_jax.train.demo_models import demo_config

    raw = demo_config(family)
    raw["text_config"]["num_hidden_layers"] = depth
    raw["vision_config"]["num_hidden_layers" if family == "internvl" else "depth"] = depth
    config = parse_config(raw)
    ex = PlanExecutor(config, jax.devices()[:1])
    ex.bind(abstract_params(config))
    text = ex.lower(1, 16, tuple(jax.devices()[:1])).as_text()
    return len(re.findall(r"^\s*(?:%\S+(?:, %\S+)* = )?\"?[a-z_]+\.[a-z_.]+", text, re.M))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl", "internvl"])
def test_family_program_ops_do_not_grow_with_depth(family):
    shallow, deep = program_ops(family, 2), program_ops(family, 4)
    print(f"{family}: {shallow} ops at depth 2, {deep} at depth 4")
    assert shallow > 100
    assert deep == shallow
