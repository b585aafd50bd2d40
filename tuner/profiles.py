"""Evaluation profiles: how much work one trial's accuracy costs, and how parts are weighted.

The combined accuracy is a weighted mean of the parts that ran:
    passkey 0.25, kv_lookup 0.25, fidelity 0.5 (gsm8k 0.25 when a JSONL file is given)
Long-output fidelity weighs most: PN-Mix is for long generation, where the keys of generated
tokens are themselves quantized. The fidelity part's score is exp(-mean KL(p_fp16 || p_quant))
per token along fp16 trajectories: 1 for an exact cache, -> 0 as the distributions part.
"""

from __future__ import annotations

from dataclasses import dataclass

from pnmix.errors import PNMixError

WEIGHTS = {"passkey": 0.25, "kv_lookup": 0.25, "fidelity": 0.5, "gsm8k": 0.25}


@dataclass(frozen=True)
class Profile:
    name: str
    passkey_items: int  # kept after filtering against the fp16 run
    passkey_filler: tuple[int, int]  # filler sentences, min..max (about 28 tokens each)
    kv_items: int
    kv_pairs: tuple[int, int]  # pairs in the list, min..max
    fidelity_prompts: int
    fidelity_tokens: int  # teacher-forced tokens per fp16 trajectory
    proxy_tokens: int  # generated tokens in the proxy's Q/K trace


PROFILES = {
    "quick": Profile("quick", passkey_items=3, passkey_filler=(18, 30), kv_items=3, kv_pairs=(20, 40),
                     fidelity_prompts=1, fidelity_tokens=512, proxy_tokens=256),
    "full": Profile("full", passkey_items=10, passkey_filler=(20, 47), kv_items=8, kv_pairs=(20, 80),
                    fidelity_prompts=3, fidelity_tokens=512, proxy_tokens=512),
    # Tiny sizes for tests and demos: seconds per trial, numbers too noisy for real decisions.
    "smoke": Profile("smoke", passkey_items=1, passkey_filler=(6, 8), kv_items=1, kv_pairs=(8, 10),
                     fidelity_prompts=1, fidelity_tokens=160, proxy_tokens=192),
}


class EvalError(PNMixError):
    pass


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise EvalError(f"unknown profile {name!r}: allowed {', '.join(PROFILES)}") from None
