"""Evaluation profiles: how much work one trial's accuracy costs (how the parts weigh:
tuner/scoring/parts.py).

The fidelity part's score is exp(-mean KL(p_fp16 || p_quant)) per token along fp16 trajectories:
1 for an exact cache, -> 0 as the distributions part.
"""

from __future__ import annotations

from dataclasses import dataclass

from pnmix.tuner.errors import EvalError


@dataclass(frozen=True)
class Profile:
    name: str
    passkey_items: int  # kept after filtering against the fp16 run
    passkey_filler: tuple[int, int]  # filler sentences, min..max (about 13 tokens each)
    passkey_digits: int
    passkey_distractors: int  # near-miss codes in the text
    kv_items: int
    kv_pairs: tuple[int, int]  # facts in the list, min..max (about 10 tokens each)
    kv_digits: int
    kv_near_miss: int  # facts whose number is one digit from the answer
    fidelity_prompts: int
    fidelity_tokens: int  # teacher-forced tokens per fp16 trajectory
    proxy_tokens: int  # generated tokens in the proxy's Q/K trace
    pool_factor: int = 4  # candidates generated per kept item (fp16 must answer the kept ones)


# Sized so that in `full` the combined accuracy's standard error stays <= 0.02 for configs
# scoring 0.5-0.9 (tuner/scoring/stats.py): at p = 0.5, 100 items give an item part 0.05, weighted 0.25.
PROFILES = {
    "quick": Profile("quick", passkey_items=12, passkey_filler=(24, 64), passkey_digits=7, passkey_distractors=2,
                     kv_items=12, kv_pairs=(12, 36), kv_digits=7, kv_near_miss=2,
                     fidelity_prompts=2, fidelity_tokens=512, proxy_tokens=256),
    "full": Profile("full", passkey_items=100, passkey_filler=(40, 200), passkey_digits=7, passkey_distractors=3,
                    kv_items=100, kv_pairs=(20, 80), kv_digits=7, kv_near_miss=3,
                    fidelity_prompts=8, fidelity_tokens=512, proxy_tokens=512),
    # Tiny sizes for tests and demos: seconds per trial, numbers too noisy for real decisions.
    "smoke": Profile("smoke", passkey_items=2, passkey_filler=(8, 10), passkey_digits=5, passkey_distractors=0,
                     kv_items=2, kv_pairs=(8, 10), kv_digits=5, kv_near_miss=0,
                     fidelity_prompts=2, fidelity_tokens=96, proxy_tokens=192),
}



def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise EvalError(f"unknown profile {name!r}: allowed {', '.join(PROFILES)}") from None
