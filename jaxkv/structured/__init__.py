"""Structured output: grammars (JSON schema, regex, choice) as token automata a jitted step
can follow on the device (`automaton.py` compiles them, `pool.py` lays several in one set of
arrays and looks them up, `vocab.py` reads the bytes of each token id)."""
