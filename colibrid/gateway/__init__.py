"""colibri-openai: an OpenAI-compatible HTTP gateway to colibrid, with Prometheus metrics.

A separate process (and systemd service) from colibrid, so the daemon keeps its sandbox
without network access: this one listens on TCP and speaks colibrid's protocol on its Unix
socket. docs/gateway.md describes the endpoints, the settings, auth and the metrics.

  config.py        the settings (TOML file and flags)
  main.py          start-up: the listening socket (own, or systemd's), serving, shutdown
  app.py           the routes: a request's life from HTTP body to colibrid and back
  openai_api.py    OpenAI request bodies checked and mapped to `ask` fields; response shapes
  model_output.py  the model's text read back: content, reasoning, tool calls per family
  daemon_client.py colibrid's protocol on asyncio
  metrics.py       /metrics: the gateway's counters and histograms, the daemon's gauges
"""
