"""Routed experts: where their weights come from (resident, streamed) and the expert
cache (AEPC) that holds the streamed ones."""
