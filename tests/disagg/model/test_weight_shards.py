"""A model built for its shapes (weight_shards' meta model) runs no arithmetic on the meta device,
so a process that only asks for shapes never imports torch._dynamo (a second of its start);
the rotary tables of a model built on the meta device are the CPU ones."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from disagg.model.rope import RotaryEmbedding
from disagg.model.transformer import Transformer
from disagg.model_config import PRESETS, RopeScaling

SCALINGS = (RopeScaling("linear", factor=2.0), RopeScaling("dynamic", factor=2.0),
            RopeScaling("llama3", factor=8.0, original_max_position_embeddings=64),
            RopeScaling("yarn", factor=4.0, original_max_position_embeddings=64))


def test_shapes_and_cuts_of_every_preset_and_scaling_leave_dynamo_unimported() -> None:
    script = textwrap.dedent("""
        import dataclasses, sys
        from disagg.model.sharding import Sharding
        from disagg.model.tensor_parallel import TPShard
        from disagg.model.weight_shards import parameter_shapes, rank_cuts
        from disagg.model_config import PRESETS
        from tests.disagg.model.test_weight_shards import SCALINGS
        for config in PRESETS.values():
            parameter_shapes(config)
            rank_cuts(config, TPShard(1, Sharding.of_model(config, 2, False)))
        for scaling in SCALINGS:
            parameter_shapes(dataclasses.replace(PRESETS["tiny"], rope_scaling=scaling))
        print("torch._dynamo" in sys.modules)
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                            cwd=Path(__file__).parents[3],
                            timeout=120, check=True)
    assert result.stdout.strip() == "False"


def test_a_meta_built_models_rotary_tables_are_the_cpu_ones() -> None:
    for scaling in (None, *SCALINGS):
        config = dataclasses.replace(PRESETS["tiny"], rope_scaling=scaling)
        with torch.device("meta"):
            meta = Transformer(config)
        assert all(p.is_meta for p in meta.parameters())
        cpu = RotaryEmbedding.for_model(config)
        for name, table in cpu.named_buffers():
            assert torch.equal(meta.rope.get_buffer(name), table), (scaling, name)


def test_the_embedding_is_still_drawn_as_nn_embedding_draws_it() -> None:
    torch.manual_seed(3)
    model = Transformer(PRESETS["tiny"])
    torch.manual_seed(3)
    reference = torch.nn.Embedding(PRESETS["tiny"].vocab_size, PRESETS["tiny"].hidden_size)
    assert torch.equal(model.embed_tokens.weight, reference.weight)
    assert model.embed_tokens.weight.requires_grad == reference.weight.requires_grad
