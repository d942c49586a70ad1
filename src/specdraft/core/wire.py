"""What the draft API promises, written once: every layer that drafts, serves, evaluates or checks uses these."""

DRAFT_TOKENS = 16  # a draft's length: what `POST /draft` answers by default, and the target tokens per evaluation point
MAX_DRAFT_TOKENS = 64  # the most tokens a request or an evaluation may ask for
# The most alternatives per drafted token the server answers: q is known whole (and speculative sampling with the
# server's drafts lossless) only when top_k is at most this
MAX_TOP_ALTERNATIVES = 64
# The most proposed continuations (guides) one greedy draft may follow: prompt lookup's copies after each earlier
# occurrence of the matched tokens, the latest first
MAX_GUIDES = 8
