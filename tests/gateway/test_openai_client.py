"""The official openai package against colibri-openai in front of a real colibrid (the demo
pack): chat and completions, streamed and not, give the daemon's own greedy tokens."""

from __future__ import annotations

import pytest

from tests.daemon.wire import WireClient

openai = pytest.importorskip("openai")

PROMPT = "def fibonacci(n):"


def _client(gateway, **kwargs):
    return openai.OpenAI(base_url=gateway.url + "/v1", api_key="unused", max_retries=0, timeout=30, **kwargs)


def _daemon_answer(daemon, **ask) -> tuple[str, dict]:
    """What colibrid itself answers: the text and the done event."""
    with WireClient(daemon.socket_path) as client:
        client.hello()
        client.send({"op": "ask", "id": 1, "temperature": 0, "max_tokens": 12, **ask})
        tokens, done = client.collect(1)
    assert done["event"] == "done", done
    return "".join(token["text"] for token in tokens), done


def test_chat_completion_is_the_daemon_s_answer(demo_daemon, demo_gateway):
    text, done = _daemon_answer(demo_daemon, messages=[{"role": "system", "content": "Be brief."},
                                                       {"role": "user", "content": PROMPT}])
    completion = _client(demo_gateway).chat.completions.create(
        model="demo", messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": PROMPT}],
        temperature=0, max_tokens=12)
    assert completion.object == "chat.completion" and completion.model == "demo"
    choice = completion.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == "length"
    assert completion.usage.prompt_tokens == done["usage"]["prompt_tokens"]
    assert completion.usage.completion_tokens == 12 and completion.usage.total_tokens == completion.usage.prompt_tokens + 12


def test_streamed_chat_gives_the_same_text_and_usage_in_the_final_chunk(demo_daemon, demo_gateway):
    text, done = _daemon_answer(demo_daemon, messages=[{"role": "user", "content": PROMPT}])
    stream = _client(demo_gateway).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=12, stream=True,
        stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert len({c.id for c in chunks}) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    assert chunks[-1].usage.prompt_tokens == done["usage"]["prompt_tokens"]
    assert all(c.usage is None for c in chunks[:-1])


def test_a_chat_asked_again_reports_its_reused_prompt_tokens_as_cached(demo_daemon, demo_gateway):
    messages = [{"role": "user", "content": "Summarise this twice: " + "the fox jumps over the dog; " * 6}]
    client = _client(demo_gateway)
    first, again = (client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=6)
                    for _ in range(2))
    assert again.choices[0].message.content == first.choices[0].message.content
    assert first.usage.prompt_tokens == again.usage.prompt_tokens > 16
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # colibrid kept the first answer's state: all but the last prompt token (its logits start the answer)
    assert again.usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1
    streamed = list(client.chat.completions.create(model="demo", messages=messages, temperature=0, max_tokens=6,
                                                   stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == again.usage.prompt_tokens - 1


def test_completions_are_the_raw_prompt_s_continuation(demo_daemon, demo_gateway):
    text, _ = _daemon_answer(demo_daemon, prompt=PROMPT, raw=True)
    client = _client(demo_gateway)
    completion = client.completions.create(model="demo", prompt=PROMPT, temperature=0, max_tokens=12)
    assert completion.object == "text_completion" and completion.choices[0].text == text
    streamed = client.completions.create(model="demo", prompt=PROMPT, temperature=0, max_tokens=12, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text


def test_seed_temperature_top_p_and_stop_reach_the_daemon(demo_daemon, demo_gateway):
    ask = dict(prompt=PROMPT, raw=True, temperature=0.9, top_p=0.8, seed=7, max_tokens=12)
    text, _ = _daemon_answer(demo_daemon, **ask)
    client = _client(demo_gateway)
    sampled = client.completions.create(model="demo", prompt=PROMPT, temperature=0.9, top_p=0.8, seed=7,
                                        max_tokens=12)
    assert sampled.choices[0].text == text
    stop = text[len(text) // 2:][:3]
    stopped, _ = _daemon_answer(demo_daemon, **ask, stop=[stop])
    cut = client.completions.create(model="demo", prompt=PROMPT, temperature=0.9, top_p=0.8, seed=7, max_tokens=12,
                                    stop=stop)
    assert cut.choices[0].text == stopped and cut.choices[0].finish_reason == "stop"


def test_logprobs_come_back_in_the_chat_shape(demo_gateway):
    completion = _client(demo_gateway).chat.completions.create(
        model="demo", messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=4, logprobs=True,
        top_logprobs=3)
    entries = completion.choices[0].logprobs.content
    assert len(entries) == 4
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob >= entry.top_logprobs[2].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)  # greedy: the best one was chosen


def test_models_lists_the_served_model(demo_gateway):
    models = _client(demo_gateway).models.list()
    assert [model.id for model in models.data] == ["demo"]
    assert _client(demo_gateway).models.retrieve("demo").id == "demo"
    with pytest.raises(openai.NotFoundError):
        _client(demo_gateway).models.retrieve("other")


def test_n_above_one_is_refused_the_openai_way(demo_gateway):
    with pytest.raises(openai.BadRequestError) as caught:
        _client(demo_gateway).chat.completions.create(model="demo", messages=[{"role": "user", "content": "hi"}], n=2)
    assert caught.value.body["param"] == "n" and caught.value.body["type"] == "invalid_request_error"
