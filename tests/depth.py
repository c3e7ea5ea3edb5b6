"""How deep the suite checks each family (issue 76: about forty families on a 15-minute cold budget).

IN_DEPTH: the fifteen families the harness was built on, checked on every path the suite has (bf16 against
HF's own error, the streamed reference and production model, the drill's points, every fault of the seeded
catalogue on two of the fifteen it applies to, each family clean at three seeds: tests/test_faults.py). Every other family (BREADTH) is checked at the depth that proves its own file:
its ModelArgs and checkpoint layouts, eager fp32 against HF block by block and end to end, the HF reference
against itself, the first streamed reference, mlx-lm's model where mlx-lm has the family, the MLX delegate's
transformations, and each fault that no in-depth family has (the mechanism the family brought) on the first
family it applies to. The whole catalogue over every family is `oracle selftest`'s job
(`oracle selftest --backend eager`), not the suite's; so are the other backends' checks (`oracle matrix`)."""

from models import FAMILY_NAMES

IN_DEPTH = ("qwen3_5_moe", "qwen3_moe", "olmoe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3", "dots1",
            "ernie4_5_moe", "glm4_moe", "gpt_oss", "granitemoe", "llama4", "phimoe", "qwen3_next")
assert set(IN_DEPTH) <= set(FAMILY_NAMES), set(IN_DEPTH) - set(FAMILY_NAMES)
BREADTH = tuple(f for f in FAMILY_NAMES if f not in IN_DEPTH)
