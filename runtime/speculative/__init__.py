"""Speculative decoding: the config, the proposers, and the verifier the engine calls.

Before a step, each decode sequence may get up to `num_speculative_tokens` draft tokens from a proposer
(proposer.py). `ngram` (ngram.py): the tokens that followed the latest earlier occurrence of its last n
tokens (n from `prompt_lookup_max` down to `prompt_lookup_min`) in its own prompt and output.
`draft_model` (draft_model.py): a smaller model's tokens, its argmax for greedy requests and drawn from
its softmax at the request's temperature for sampled ones.

The step computes the last real token and the drafts as one chunk (their logits rows in one pass over
the weights); the verifier (decoder.py) then samples each row in order and goes on while the token
equals the next draft. Greedy rows take the argmax, so a sequence's tokens are those it would have made
one at a time (the kernels are batch-invariant: a row's logits do not depend on how many rows come with
it). Sampled rows keep a draft drawn from q with probability min(1, p(draft) / q(draft)) and otherwise
draw from norm(max(p - q, 0)) (the exact rejection rule; an n-gram's q is one-hot), so each token is
distributed as without speculation. A rejected draft's cache slot is overwritten later. A constrained
row is masked by its matcher as it stands after the tokens before it (the matcher only ever takes
verified tokens, so it never rolls back).
"""

from kiln.runtime.speculative.config import METHODS, SpeculativeConfig

__all__ = ["METHODS", "SpeculativeConfig"]
