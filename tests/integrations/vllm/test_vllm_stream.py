"""The stream relay's pieces without vLLM: what a continuation asks for, how its chunks are
made the original stream's, and which ids the client gets (the live failover is in
test_vllm_e2e.py)."""

from __future__ import annotations

from topkv.integrations.vllm.frontdoor.stream import (
    StreamState,
    as_client_chunk,
    can_fail_over,
    continuation_body,
)


def test_a_continuation_asks_for_the_tokens_still_owed() -> None:
    state = StreamState(chat=False, client_wants_ids=False, prompt_ids=[1, 2, 3])
    state.generated = [7, 8]
    body = {
        "model": "m", "prompt": "abc", "max_tokens": 10, "min_tokens": 5, "temperature": 0,
        "ignore_eos": True, "stream": True, "echo": True, "logprobs": 2,
        "kv_transfer_params": {"do_remote_prefill": True},
    }  # fmt: skip
    out = continuation_body(body, state, [1, 2, 3, 7, 8])
    assert out == {
        "model": "m", "temperature": 0, "ignore_eos": True, "logprobs": 2,
        "prompt": [1, 2, 3, 7, 8], "max_tokens": 8, "min_tokens": 3, "stream": True,
        "return_token_ids": True,
    }  # fmt: skip
    # vLLM's completions default (16) when the client gave none; a chat keeps none
    assert continuation_body({"model": "m"}, state, [1])["max_tokens"] == 14
    chat = StreamState(chat=True, client_wants_ids=False, prompt_ids=[1])
    assert "max_tokens" not in continuation_body({"model": "m", "logprobs": True}, chat, [1])
    assert continuation_body({"max_completion_tokens": 4}, chat, [1])["max_tokens"] == 4


def test_continuation_chunks_become_the_original_streams() -> None:
    state = StreamState(chat=True, client_wants_ids=False, chunk_id="chatcmpl-1", created=5)
    chunk = {
        "id": "cmpl-9", "object": "text_completion", "created": 9,
        "choices": [{"index": 0, "text": "hi", "token_ids": [4], "finish_reason": None}],
    }  # fmt: skip
    as_client_chunk(chunk, state, sent_before=3)
    assert chunk == {
        "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 5,
        "choices": [{"index": 0, "delta": {"content": "hi"}, "logprobs": None,
                     "finish_reason": None, "token_ids": [4]}],
    }  # fmt: skip
    usage = {"id": "x", "choices": [], "usage": {"prompt_tokens": 13, "completion_tokens": 2}}
    as_client_chunk(usage, StreamState(chat=False, client_wants_ids=False), sent_before=3)
    assert usage["usage"] == {"prompt_tokens": 10, "completion_tokens": 5}


def test_the_state_keeps_the_ids_and_strips_what_the_client_did_not_ask_for() -> None:
    state = StreamState(chat=False, client_wants_ids=False)
    first = {"id": "c1", "choices": [{"text": "a", "token_ids": [5], "prompt_token_ids": [1, 2]}]}
    state.note(first)
    state.strip(first)
    assert (state.prompt_ids, state.generated, state.chunk_id) == ([1, 2], [5], "c1")
    assert first["choices"] == [{"text": "a"}] and state.first_token.is_set()
    chat = StreamState(chat=True, client_wants_ids=True)
    role = {"id": "c2", "prompt_token_ids": [3], "choices": [{"delta": {"role": "assistant"}}]}
    chat.note(role)
    chat.strip(role)
    assert chat.prompt_ids == [3] and role["prompt_token_ids"] == [3]  # asked for: kept
    assert not chat.first_token.is_set()
    assert can_fail_over({}) and can_fail_over({"n": 1}) and not can_fail_over({"n": 2})
