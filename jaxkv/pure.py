"""The pure API (CONTRACT §10.3): every verb as a jittable function of `(config, state, ...)`.

Each returns a new state plus an int32 `Status` (and an id for `seq_new` and
`seq_clone`). Jit them with `config` static and the state donated
(`donate_argnums=1`); a whole decode loop then runs inside one `jax.jit`.
"""

from jaxkv._attend import attend
from jaxkv._verbs import (
    WHOLE,
    clear,
    commit_step,
    declare_step,
    floor,
    grow,
    prepare_step,
    rewind,
    rows_needed,
    run_narrow,
    seq_clone,
    seq_new,
    seq_rm,
)

__all__ = [
    "WHOLE",
    "attend",
    "clear",
    "commit_step",
    "declare_step",
    "floor",
    "grow",
    "prepare_step",
    "rewind",
    "rows_needed",
    "run_narrow",
    "seq_clone",
    "seq_new",
    "seq_rm",
]
