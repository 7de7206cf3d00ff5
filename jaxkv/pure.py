"""The pure API (CONTRACT §10.3): every verb as a jittable function of `(config, state, ...)`.

Each returns a new state plus an int32 `Status` (and an id for `seq_new` and
`seq_clone`). Jit them with `config` static and the state donated
(`donate_argnums=1`); a whole decode loop then runs inside one `jax.jit`.

Ids and positions: pass int32 (a Python int or an `int32` array). Inside the
verbs every id outside `[0, max_seqs)` and every out-of-range position is
refused with a status (NOT_LIVE, BAD_TARGET, ...) and the state is unchanged;
a wider traced integer (x64 on) saturates instead of wrapping, so it is
refused too. What the verbs cannot see is a cast at the jit boundary: with
`jax_enable_x64` off, JAX casts a wider NumPy argument of a jitted function
(`np.int64(2**32)`) to int32 before the verb runs, so `2**32` arrives as id 0
and removes live sequence 0. Callers that take ids from outside (requests,
NumPy arrays) must check or clamp them to int32 on the host before the call,
as the facade (`jaxkv.BatchedSequenceCache`) and `jaxkv.serve` do. Concrete
values passed to an unjitted verb are checked at trace time (ValueError).

The cache is created with every flat row by default (`CacheConfig`'s
`initial_capacity=None`), so a jitted loop never meets NEEDS_ROWS; a config
with a smaller `initial_capacity` asks for growth, which is host-only
(`grow`), and a loop must stop on NEEDS_ROWS to grow between entries.
"""

from jaxkv._attend import KVDtypeWarning, attend
from jaxkv._verbs import (
    WHOLE,
    clear,
    commit_step,
    declare_step,
    floor,
    grow,
    prepare_step,
    rewind,
    rewind_many,
    rows_needed,
    run_narrow,
    seq_clone,
    seq_new,
    seq_rm,
)

__all__ = [
    "KVDtypeWarning",
    "WHOLE",
    "attend",
    "clear",
    "commit_step",
    "declare_step",
    "floor",
    "grow",
    "prepare_step",
    "rewind",
    "rewind_many",
    "rows_needed",
    "run_narrow",
    "seq_clone",
    "seq_new",
    "seq_rm",
]
