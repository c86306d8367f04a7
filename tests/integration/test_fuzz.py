"""Fuzzing every service's endpoints (hypothesis): random bytes, and well-formed messages
with extreme values. Each call must end in a gRPC status (never UNKNOWN, the status of an
unhandled exception; never a hang), and afterwards the services are healthy and idle."""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protos.specd.v1 import common_pb2, drafter_pb2, router_pb2, verifier_pb2
from specd.channels import check_health
from tests.cluster import TINY_MODEL_ID, start_cluster
from tests.integration.openai_api.door import post_json
from tests.integration.test_services import wait_idle

FUZZ = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    derandomize=True,  # the same examples every run: a failure is reproducible
)
# far past what any request the tiny models accept takes (at most their 512-token
# context): a call that runs out of it hung, and fails the test
TIMEOUT_S = 60.0
# a handler that raised gives UNKNOWN (so would undecodable bytes, without
# specd/request_decoding.py); INTERNAL is for our own failures
NEVER = {grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL}
# well-formed messages are served or refused with a reason
SERVED_OR_REFUSED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT}

int32 = st.integers(-(2**31), 2**31 - 1)
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
text = st.text(max_size=200)


@pytest.fixture(scope="module")
def cluster(tiny_pair):
    c = start_cluster(*tiny_pair, replicas=1)
    yield c
    c.close()


def sampling_params():
    return st.builds(
        common_pb2.SamplingParams,
        temperature=float32,
        top_p=float32,
        top_k=int32,
        seed=st.integers(0, 2**64 - 1),
        min_p=float32,
        logprobs=st.one_of(st.none(), st.integers(-2, 22), int32),
        presence_penalty=float32,
        frequency_penalty=float32,
        logit_bias=st.dictionaries(st.one_of(st.integers(-2, 100), int32), float32, max_size=3),
        min_tokens=st.one_of(st.integers(-2, 40), int32),
    )


def router_requests():
    def build(
        source, prompt, messages, ids, max_new, params, stop, route, spec, ignore, stops, chat
    ):
        req = router_pb2.GenerateRequest(
            max_new_tokens=max_new,
            params=params,
            stop=stop,
            route=route,
            speculation=spec,
            ignore_eos=ignore,
            stop_token_ids=stops,
        )
        if source == "prompt":
            req.prompt = prompt
        elif source == "messages":
            req.messages.messages.extend(
                router_pb2.ChatMessage(role=r, content=c) for r, c in messages
            )
            req.messages.continue_final_message, req.messages.chat_template_kwargs_json = chat
        elif source == "ids":
            req.token_ids.ids.extend(ids)
        return req

    return st.builds(
        build,
        st.sampled_from(["prompt", "messages", "ids", "none"]),
        text,
        st.lists(st.tuples(st.sampled_from(["user", "system", "assistant", ""]), text)),
        st.lists(int32, max_size=50),
        st.one_of(st.integers(-5, 40), int32),
        sampling_params(),
        st.lists(text, max_size=5),
        st.one_of(st.sampled_from(["", "default", "code"]), text),
        st.integers(0, 2**31 - 1),  # includes values the enum does not define
        st.booleans(),
        st.lists(st.one_of(st.integers(-2, 100), int32), max_size=3),
        st.tuples(st.booleans(), st.one_of(st.just(""), text, st.just('{"messages": 1}'))),
    )


def verifier_requests():
    return st.builds(
        verifier_pb2.VerifyGenerateRequest,
        prompt_ids=st.lists(int32, max_size=50),
        params=sampling_params(),
        max_new_tokens=st.one_of(st.integers(-5, 40), int32),
        stop_ids=st.lists(int32, max_size=5),
        ignore_eos=st.booleans(),
        num_draft_tokens=st.one_of(st.integers(-3, 20), int32),
        route=text,
    )


def draft_requests():
    def command(seq_id, which, ids, params, k):
        cmd = drafter_pb2.SeqCommand(seq_id=seq_id)
        if which == "open":
            cmd.open.token_ids.extend(ids)
            cmd.open.params.CopyFrom(params)
        elif which == "step":
            cmd.step.committed_ids.extend(ids)
            cmd.step.k = k
        else:
            cmd.close.SetInParent()
        return cmd

    commands = st.builds(
        command,
        st.integers(0, 4),
        st.sampled_from(["open", "step", "close"]),
        st.lists(st.one_of(st.integers(0, 95), int32), max_size=30),
        sampling_params(),
        st.one_of(st.integers(-2, 20), int32),
    )
    return st.builds(
        lambda rnd, cmds: drafter_pb2.DraftRequest(round=rnd, commands=cmds),
        st.integers(0, 2**64 - 1),
        st.lists(commands, max_size=6),
    )


def status_of(responses) -> grpc.StatusCode:
    try:
        for _ in responses:
            pass
        return grpc.StatusCode.OK
    except grpc.RpcError as exc:
        return exc.code()


def call_raw(address: str, method: str, kind: str, payload):
    """Call `method` with `payload` (bytes, or a list of bytes for a client stream)."""
    with grpc.insecure_channel(address) as channel:
        if kind == "unary":
            stub = channel.unary_unary(method)
            try:
                stub(payload, timeout=TIMEOUT_S)
                return grpc.StatusCode.OK
            except grpc.RpcError as exc:
                return exc.code()
        if kind == "server-stream":
            return status_of(channel.unary_stream(method)(payload, timeout=TIMEOUT_S))
        return status_of(channel.stream_stream(method)(iter(payload), timeout=TIMEOUT_S))


ENDPOINTS = [
    ("router", "/specd.v1.Generation/Generate", "unary"),
    ("router", "/specd.v1.Generation/GenerateStream", "server-stream"),
    ("verifier", "/specd.v1.Verifier/Generate", "server-stream"),
    ("verifier", "/specd.v1.Verifier/Info", "unary"),
    ("drafter", "/specd.v1.Drafter/Draft", "bidi"),
]


def address(cluster, service: str) -> str:
    return {"router": cluster.router, "verifier": cluster.verifiers[0]}.get(
        service, cluster.drafter
    )


def settle(cluster) -> None:
    for service in ("router", "verifier", "drafter"):
        assert check_health(address(cluster, service))
    assert wait_idle(cluster), "KV blocks or drafter sessions left behind"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("service,method,kind", ENDPOINTS)
def test_random_bytes_get_a_status(cluster, service, method, kind):
    seen = set()

    @FUZZ
    @given(payload=st.binary(max_size=300))
    def check(payload):
        code = call_raw(
            address(cluster, service), method, kind, [payload] if kind == "bidi" else payload
        )
        seen.add(code)
        assert code not in NEVER | {grpc.StatusCode.DEADLINE_EXCEEDED}, (payload, code)

    check()
    settle(cluster)
    assert seen  # every example was answered


@pytest.mark.parametrize("service,method,kind", ENDPOINTS)
def test_undecodable_bytes_are_an_invalid_argument(cluster, service, method, kind):
    with grpc.insecure_channel(address(cluster, service)) as channel:
        payload = b"\x00"  # field number 0: never valid protobuf
        with pytest.raises(grpc.RpcError) as err:
            if kind == "unary":
                channel.unary_unary(method)(payload, timeout=TIMEOUT_S)
            elif kind == "server-stream":
                list(channel.unary_stream(method)(payload, timeout=TIMEOUT_S))
            else:
                list(channel.stream_stream(method)(iter([payload]), timeout=TIMEOUT_S))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "undecodable request" in err.value.details()


@pytest.mark.timeout(600)
@FUZZ
@given(request=router_requests(), stream=st.booleans())
def test_extreme_router_requests_get_a_clear_status(cluster, request, stream):
    method = "GenerateStream" if stream else "Generate"
    kind = "server-stream" if stream else "unary"
    code = call_raw(
        cluster.router, f"/specd.v1.Generation/{method}", kind, request.SerializeToString()
    )
    assert code in SERVED_OR_REFUSED, (request, code)


@pytest.mark.timeout(600)
@FUZZ
@given(request=verifier_requests())
def test_extreme_verifier_requests_get_a_clear_status(cluster, request):
    code = call_raw(
        cluster.verifiers[0],
        "/specd.v1.Verifier/Generate",
        "server-stream",
        request.SerializeToString(),
    )
    assert code in SERVED_OR_REFUSED, (request, code)


@pytest.mark.timeout(600)
@FUZZ
@given(requests=st.lists(draft_requests(), min_size=1, max_size=4))
def test_extreme_draft_rounds_are_answered_per_sequence(cluster, requests):
    code = call_raw(
        cluster.drafter,
        "/specd.v1.Drafter/Draft",
        "bidi",
        [r.SerializeToString() for r in requests],
    )
    # the drafter refuses bad commands per sequence (an error in that proposal) and keeps
    # the stream: a well-formed round is always answered
    assert code == grpc.StatusCode.OK, (requests, code)


# strings as a JSON body may spell them: lone UTF-16 surrogates too (a "\ud800" escape)
json_text = st.one_of(
    text, st.tuples(text, st.sampled_from(["\ud800", "\udfff", "\udc00\ud800"])).map("".join)
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | json_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_text, inner, max_size=4),
    max_leaves=12,
)
# most fields take a string or a list of them: those come often
field_values = st.one_of(json_text, st.lists(json_text, max_size=3), json_values)
# and a body valid but for its text: the prompt (a chat's message), stop strings, route
text_fields = st.fixed_dictionaries(
    {"prompt": json_text},
    optional={"stop": st.lists(json_text, max_size=3), "route": json_text, "user": json_text},
)
HEADERS = ["x-route", "x-speculation", "x-request-timeout", "traceparent", "authorization"]
# what the OpenAI door reads, and a few it refuses
BODY_FIELDS = [
    *("model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature"),
    *("top_p", "top_k", "min_p", "seed", "stop", "stream", "stream_options", "n", "logprobs"),
    *("top_logprobs", "prompt_logprobs"),
    *("response_format", "guided_json", "guided_regex", "guided_grammar", "speculation"),
    *("route", "ignore_eos", "repetition_penalty", "tools", "tool_choice", "bogus"),
    *("parallel_tool_calls", "echo", "suffix", "guided_choice", "structured_outputs"),
    *("presence_penalty", "frequency_penalty", "logit_bias"),
    *("stop_token_ids", "min_tokens", "include_stop_str_in_output", "skip_special_tokens"),
    *("add_generation_prompt", "continue_final_message", "chat_template_kwargs"),
    # the Responses API's
    *("input", "instructions", "max_output_tokens", "text", "previous_response_id", "store"),
    *("metadata", "include", "reasoning", "truncation"),
    # Anthropic's Messages API's
    *("system", "stop_sequences", "output_config", "thinking"),
    # llama-server's sampler fields
    *("samplers", "cache_prompt", "typical_p", "repeat_penalty"),
]
DOORS = ["chat/completions", "completions", "responses", "messages"]


@pytest.mark.timeout(600)
@settings(FUZZ, max_examples=300)  # a refusal takes a millisecond
@given(
    door=st.sampled_from(DOORS),
    headers=st.dictionaries(
        st.sampled_from(HEADERS),
        st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=60),
        max_size=2,
    ),
    fields=st.one_of(
        st.dictionaries(st.sampled_from(BODY_FIELDS), field_values, max_size=3), text_fields
    ),
)
def test_any_json_body_is_served_or_refused_in_the_openai_shape(cluster, door, headers, fields):
    """A served body with up to three fields set to any JSON value, or with any text where
    it takes text, and any of the headers the door reads: 200, or a 4xx in the OpenAI
    error shape (Anthropic's at its door), never a 500 (an exception the door did not
    expect)."""
    body, fields = {"model": TINY_MODEL_ID, "max_tokens": 4, "prompt": "def f(x):"}, dict(fields)
    if door != "completions":
        prompt = fields.pop("prompt", body.pop("prompt"))
        body["messages"] = [{"role": "user", "content": prompt}]
    if door == "responses":
        body = {"model": TINY_MODEL_ID, "max_output_tokens": 4, "input": prompt}
    reply = post_json(f"{cluster.http}/v1/{door}", json.dumps(body | fields).encode(), headers)
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, (headers, fields, reply.text)
    if reply.status_code != 200:
        error = reply.json()["error"]
        assert error["message"] and error["type"].endswith("_error"), (fields, error)


# what llama-server's /completion reads (router/llamacpp_schema.py), and one it refuses
LLAMACPP_FIELDS = [
    *("prompt", "n_predict", "temperature", "top_k", "top_p", "min_p", "seed", "stop"),
    *("stream", "ignore_eos", "logit_bias", "n_probs", "samplers", "json_schema", "grammar"),
    *("return_tokens", "response_fields", "n_indent", "t_max_predict_ms", "repeat_penalty"),
    *("dry_multiplier", "xtc_probability", "xtc_threshold", "mirostat", "top_n_sigma"),
    *("min_keep", "post_sampling_probs", "lora", "n_cmpl", "cache_prompt", "speculation"),
    "bogus",
]


@pytest.mark.timeout(600)
@settings(FUZZ, max_examples=200)
@given(fields=st.dictionaries(st.sampled_from(LLAMACPP_FIELDS), field_values, max_size=3))
def test_any_json_body_at_llama_servers_completion_is_served_or_refused(cluster, fields):
    """The same for llama-server's /completion: 200, or a 4xx naming what is wrong."""
    body = {"prompt": "def f(x):", "n_predict": 4} | dict(fields)
    reply = post_json(f"{cluster.http}/completion", json.dumps(body).encode())
    assert reply.status_code == 200 or 400 <= reply.status_code < 500, (fields, reply.text)
    if reply.status_code != 200:
        assert reply.json()["error"]["message"], (fields, reply.text)


def test_services_are_healthy_and_idle_after_the_fuzzing(cluster):
    settle(cluster)


def float_fields(message) -> list[str]:
    """Every float/double field of a message type (new fields are covered by themselves)."""
    from google.protobuf.descriptor import FieldDescriptor

    kinds = (FieldDescriptor.TYPE_FLOAT, FieldDescriptor.TYPE_DOUBLE)
    return [f.name for f in message.DESCRIPTOR.fields if f.type in kinds]


NON_FINITE = [float("nan"), float("inf"), float("-inf")]
PARAM_FIELDS = float_fields(common_pb2.SamplingParams)
BOUND_FIELDS = [f for f in float_fields(verifier_pb2.VerifyGenerateRequest)]


def refusal(address: str, method: str, request) -> grpc.RpcError:
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_stream(method)(request.SerializeToString(), timeout=TIMEOUT_S)
        with pytest.raises(grpc.RpcError) as err:
            list(call)
    return err.value


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("field", PARAM_FIELDS)
def test_non_finite_sampling_params_are_refused_by_name_everywhere(cluster, field, value):
    assert {"temperature", "top_p", "min_p", "repetition_penalty"} <= set(PARAM_FIELDS)
    assert {"presence_penalty", "frequency_penalty"} <= set(PARAM_FIELDS)
    started = cluster.verifier_servicers[0].requests_started
    params = common_pb2.SamplingParams(**{field: value})
    routed = router_pb2.GenerateRequest(prompt="hello", max_new_tokens=4, params=params)
    err = refusal(cluster.router, "/specd.v1.Generation/GenerateStream", routed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
    assert cluster.verifier_servicers[0].requests_started == started  # never got that far
    direct = verifier_pb2.VerifyGenerateRequest(prompt_ids=[5, 6], max_new_tokens=4, params=params)
    err = refusal(cluster.verifiers[0], "/specd.v1.Verifier/Generate", direct)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()
    # the drafter refuses the session by name and keeps the stream
    open_cmd = drafter_pb2.DraftRequest(round=1)
    cmd = open_cmd.commands.add(seq_id=1)
    cmd.open.token_ids.extend([5, 6])
    cmd.open.params.CopyFrom(params)
    open_cmd.commands.add(seq_id=1).step.k = 2  # the refusal is the step's proposal
    with grpc.insecure_channel(cluster.drafter) as channel:
        stream = channel.stream_stream("/specd.v1.Drafter/Draft")
        responses = list(stream(iter([open_cmd.SerializeToString()]), timeout=TIMEOUT_S))
    reply = drafter_pb2.DraftResponse.FromString(responses[0])
    assert field in reply.proposals[0].error


@pytest.mark.parametrize("value", NON_FINITE, ids=str)
@pytest.mark.parametrize("field", BOUND_FIELDS)
def test_non_finite_speculation_bounds_are_refused_by_name(cluster, field, value):
    assert {"max_kv_utilization", "min_acceptance"} <= set(BOUND_FIELDS)
    request = verifier_pb2.VerifyGenerateRequest(
        prompt_ids=[5, 6], max_new_tokens=4, num_draft_tokens=2, auto=True, **{field: value}
    )
    err = refusal(cluster.verifiers[0], "/specd.v1.Verifier/Generate", request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and field in err.details()


def enum_fields(descriptor, seen=None) -> set[str]:
    """Every enum field reachable from a message type, by full name."""
    from google.protobuf.descriptor import FieldDescriptor

    seen = set() if seen is None else seen
    if descriptor.full_name in seen:
        return set()
    seen.add(descriptor.full_name)
    found = set()
    for f in descriptor.fields:
        if f.type == FieldDescriptor.TYPE_ENUM:
            found.add(f.full_name)
        elif f.type == FieldDescriptor.TYPE_MESSAGE:
            found |= enum_fields(f.message_type, seen)
    return found


def test_every_enum_field_a_service_reads_is_covered_below():
    """A new enum field in a request fails here until a test like the next one refuses
    its undefined values."""
    requests = (router_pb2.GenerateRequest, verifier_pb2.VerifyGenerateRequest)
    found = set().union(*(enum_fields(m.DESCRIPTOR) for m in (*requests, drafter_pb2.DraftRequest)))
    assert found == {"specd.v1.GenerateRequest.speculation"}


@pytest.mark.parametrize("value", [3, 99, 2**31 - 1])
def test_a_speculation_mode_the_enum_does_not_define_is_refused_by_name(cluster, value):
    """An enum field is an int32 on the wire: a value it does not define must not run as
    the default (`auto`)."""
    request = router_pb2.GenerateRequest(prompt="hi", max_new_tokens=4, speculation=value)
    err = refusal(cluster.router, "/specd.v1.Generation/GenerateStream", request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "speculation" in err.details()


def test_unknown_chat_roles_are_refused(cluster):
    request = router_pb2.GenerateRequest(max_new_tokens=4)
    request.messages.messages.add(role="wizard", content="hi")
    err = refusal(cluster.router, "/specd.v1.Generation/GenerateStream", request)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "wizard" in err.details()


@pytest.mark.parametrize("logprobs", [-1, 21, 2**31 - 1])
def test_logprobs_out_of_range_are_refused_by_name_everywhere(cluster, logprobs):
    params = common_pb2.SamplingParams(logprobs=logprobs)
    routed = router_pb2.GenerateRequest(prompt="hello", max_new_tokens=4, params=params)
    err = refusal(cluster.router, "/specd.v1.Generation/GenerateStream", routed)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in err.details()
    direct = verifier_pb2.VerifyGenerateRequest(prompt_ids=[5, 6], max_new_tokens=4, params=params)
    err = refusal(cluster.verifiers[0], "/specd.v1.Verifier/Generate", direct)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in err.details()
