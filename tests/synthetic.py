"""Synthetic episodes for trainer tests: groups of three with completions of 1..7 tokens and prompts of 2..4, so
that splits by tokens and by rank differ."""

from __future__ import annotations

import torch

from relayrl.common.pb.episode_pb2 import Episode


def varied_episodes(n: int = 12, seed: int = 0) -> list[Episode]:
    g = torch.Generator().manual_seed(seed)
    eps = []
    for i in range(n):
        n_c = 1 + (i * 5) % 7
        eps.append(
            Episode(
                episode_id=str(i),
                group_id=f"g{i // 3}",
                group_size=3,
                prompt_token_ids=torch.randint(3, 17, (2 + i % 3,), generator=g).tolist(),
                completion_token_ids=torch.randint(3, 18, (n_c,), generator=g).tolist(),
                behaviour_logprobs=(-torch.rand(n_c, generator=g) * 3).tolist(),
                token_weight_versions=[1] * n_c,
                loss_mask=[1] * n_c,
                reward=float(torch.rand(1, generator=g)),
                sampling_temperature=1.0,
            )
        )
    return eps
