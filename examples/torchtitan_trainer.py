"""torchtitan's own ``Trainer`` (its ``llama3_debugmodel`` config, the model shrunk, FSDP2
dp_shard=2 or TP=2, bf16 mixed precision, activation checkpointing) run with
``Trainer.train()`` on 2 gloo ranks on this machine, guarded by ``TitanGuard`` through a
subclass (the lines in ``GuardedTrainer`` of ``nanguard.zoo.titan_trainer``, shown in
docs/torchtitan.md). At the trainer's step 3, rank 1's ``layers.1.feed_forward.w1`` takes the
square root of negatives: the step is skipped on both ranks, named on rank 1, and training goes on.

    python examples/torchtitan_trainer.py [fsdp|tp]

The CPU patch (torchtitan picks CUDA when no accelerator is present) is applied in the ranks'
processes only; no file of torchtitan's is edited.
"""

from __future__ import annotations

import sys

from nanguard.zoo.spawn import spawn_ranks
from nanguard.zoo.titan_trainer import trainer_rank

if __name__ == "__main__":
    setup = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    for result in spawn_ranks(trainer_rank, setup, "sqrt", 1, "skip", world=2, timeout=600):
        print(f"rank {result['rank']}: trainer steps {result['steps']}, skipped {result['skipped']}")
        print(f"  logged losses {[round(x, 4) for x in result['losses']]}")
    print(result["diag"])
