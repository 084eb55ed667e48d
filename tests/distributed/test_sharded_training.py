"""A transformers Llama with mxattn's attention trains under torch's own sharding as it trains unsharded: DDP and
FSDP2 (`fully_shard`) over 2 CPU processes (gloo, the reference backend) give the single-process run's losses on
the whole batch, to fp32 reduction noise. Each rank gets half the rows; equal token counts per rank make the mean
of the ranks' mean losses the whole batch's mean, so the averaged gradients are the whole batch's."""

import json
import os
import warnings

import pytest
import torch

pytest.importorskip("transformers")
dist = pytest.importorskip("torch.distributed")
if not dist.is_available():
    pytest.skip("torch.distributed is not available in this build", allow_module_level=True)

WORLD = 2
ROWS_PER_RANK = 2
SEQ = 64
STEPS = 3


def _model():
    from transformers import LlamaConfig, LlamaForCausalLM
    import mxattn.integrations.transformers as mx_hf
    mx_hf.register("mxfp8", backend="reference")
    config = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         attn_implementation="mxfp8")
    torch.manual_seed(0)
    return LlamaForCausalLM(config).float()


def _batch():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 96, (WORLD * ROWS_PER_RANK, SEQ), generator=g)


def _train(model, ids, step_loss):
    """STEPS SGD steps on ids -> the losses step_loss(loss) reports."""
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses = []
    for _ in range(STEPS):
        loss = model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(step_loss(loss.detach()))
    return losses


def _worker(rank: int, mode: str, init_file: str, out: str) -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        model = _model()
        if mode == "ddp":
            from torch.nn.parallel import DistributedDataParallel
            model = DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
        ids = _batch()[rank * ROWS_PER_RANK:(rank + 1) * ROWS_PER_RANK]

        def global_loss(loss):
            loss = loss.clone()
            dist.all_reduce(loss)
            return loss.item() / WORLD

        losses = _train(model, ids, global_loss)
        if rank == 0:
            with open(out, "w") as f:
                json.dump(losses, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def unsharded_losses():
    warnings.simplefilter("ignore")
    return _train(_model(), _batch(), lambda loss: loss.item())


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["ddp", "fsdp2"])
def test_sharded_training_matches_the_unsharded_run(mode, unsharded_losses, tmp_path, monkeypatch):
    import torch.multiprocessing as mp
    from repo_paths import ROOT
    # the spawned ranks import this module by name: the repository and tests/ on their path
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT), str(ROOT / "tests"), os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "losses.json"
    mp.start_processes(_worker, args=(mode, str(tmp_path / "init"), str(out)), nprocs=WORLD, join=True,
                       start_method="spawn")
    sharded = json.loads(out.read_text())
    assert len(sharded) == STEPS and sharded[0] == pytest.approx(unsharded_losses[0], rel=1e-6)
    assert sharded[-1] < sharded[0], f"{mode} did not train: {sharded}"
    assert sharded == pytest.approx(unsharded_losses, rel=1e-4), (sharded, unsharded_losses)
