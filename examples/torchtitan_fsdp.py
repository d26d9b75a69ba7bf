"""torchtitan's components (llama3, FSDP2 dp_shard=2 or TP=2, its chunked loss, its optimizer and
scheduler containers) trained as its ``train_step`` trains them, guarded by ``TitanGuard``, on 2
gloo ranks on this machine. At step 2, rank 1's token ids run past the vocabulary: the step is
skipped on both ranks and named, and training goes on.

    python examples/torchtitan_fsdp.py [fsdp|tp]

The guarded loop is torchtitan's; the lines nanguard adds are marked ``# nanguard``.
"""

from __future__ import annotations

import sys

import torch

from nanguard.integrations.torchtitan import TitanGuard
from nanguard.zoo.spawn import spawn_ranks
from nanguard.zoo.titan import SEQ, VOCAB, build


def train(rank: int, world: int, setup: str) -> dict:
    parts = build(setup)
    model, loss_fn, optimizers, lr_schedulers = (parts[k] for k in ("model", "loss_fn", "optimizers", "lr_schedulers"))
    guard = TitanGuard([model], optimizers, lr_schedulers, policy="skip", check_batch=True)  # nanguard
    loss_fn = guard.loss(loss_fn)  # nanguard
    positions = torch.arange(SEQ).expand(2, SEQ)
    logged = []
    for step in range(5):
        optimizers.zero_grad()
        g = torch.Generator().manual_seed(step * 10 + (rank if setup == "fsdp" else 0))
        x = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        tokens, labels = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        if step == 2 and rank == 1:
            tokens[0, 5] = VOCAB + 3  # a tokenizer that does not match the model
        pred = model(tokens, positions=positions)
        loss, _ = loss_fn(pred, labels, torch.tensor(labels.numel() * world))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), 1.0, foreach=True)
        optimizers.step()
        lr_schedulers.step()
        if guard.step_skipped:  # nanguard: nothing to log for a step that did not happen
            continue
        logged.append(step)
    diag = guard.last_diagnosis
    guard.close()
    return {"rank": rank, "logged_steps": logged, "diagnosis": None if diag is None else str(diag)}


if __name__ == "__main__":
    setup = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    for result in spawn_ranks(train, setup, world=2, timeout=600):
        print(f"rank {result['rank']}: logged steps {result['logged_steps']}")
    print(result["diagnosis"])
