"""Routed experts: where their weights come from (resident, streamed) and the expert
cache (AEPC) that holds the streamed ones, with what it asks of the machine's memory
handed in (backing.py)."""
