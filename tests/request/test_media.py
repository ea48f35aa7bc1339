"""Media URLs in chat messages: ``data:`` URLs and the policy's allowlist only.

End to end through the official SDK (what reaches the engine, what is refused), then the rule
itself over a table of URLs that try to get past a prefix match, then the policy's entries.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from gateway.errors import InvalidRequest
from gateway.policy.loader import PolicyError
from gateway.request.media import check_media_urls, check_server_url
from gateway.service import parse_policy
from tests.conftest import CHAT_MODEL, KEY_ACME, BackendServer, StartGateway
from tests.fake_backend import FakeBackend
from tests.policy_builder import session_policy

ALLOWLIST = ("https://cdn.example.com/images/", "http://10.0.0.7:8080/media")
PNG = "data:image/png;base64,iVBORw0KGgo="


def image(url: str) -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_part(url)]}]


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


@pytest.fixture
def media_gateway(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer
) -> Iterator[openai.OpenAI]:
    text = session_policy(backend_server.url, limits={"media_url_allowlist": list(ALLOWLIST)})
    with (
        start_gateway(text, health_checks=False) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as sdk,
    ):
        yield sdk


@pytest.mark.parametrize(
    "url",
    [
        pytest.param(PNG, id="a data URL"),
        pytest.param("https://cdn.example.com/images/cat.png", id="a URL under an allowed prefix"),
        pytest.param("HTTPS://CDN.EXAMPLE.COM:443/images/cat.png", id="the same URL in capitals with its port"),
        pytest.param("http://10.0.0.7:8080/media/a.mp4", id="an internal server the operator listed"),
    ],
)
def test_data_urls_and_allowed_prefixes_reach_the_engine(
    media_gateway: openai.OpenAI, backend: FakeBackend, url: str
) -> None:
    media_gateway.chat.completions.create(model=CHAT_MODEL, messages=image(url), max_tokens=4)
    assert backend.received[-1].body["messages"] == image(url)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        pytest.param("http://169.254.169.254/latest/meta-data/", "link-local", id="the cloud metadata service"),
        pytest.param("file:///etc/passwd", "scheme", id="a local file"),
        pytest.param("https://evil.example.net/cat.png", "matches no entry", id="a host nobody listed"),
        pytest.param("http://cdn.example.com/images/cat.png", "matches no entry", id="http where https is listed"),
        pytest.param("https://cdn.example.com/imagesX/cat.png", "matches no entry", id="a prefix past a segment"),
    ],
)
def test_other_media_urls_are_refused_before_any_engine_fetches_them(
    media_gateway: openai.OpenAI, backend: FakeBackend, url: str, why: str
) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        media_gateway.chat.completions.create(model=CHAT_MODEL, messages=image(url), max_tokens=4)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("media_url_not_allowed", "messages[0].content[1].image_url.url")
    assert why in error["message"]
    assert backend.received == []


def test_without_an_allowlist_only_data_urls_pass(client: openai.OpenAI, backend: FakeBackend) -> None:
    client.chat.completions.create(model=CHAT_MODEL, messages=image(PNG), max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=CHAT_MODEL, messages=image("https://cdn.example.com/a.png"), max_tokens=4)
    assert len(backend.received) == 1


# --- the rule, URL by URL ---------------------------------------------------------------------

TRICKS = [
    pytest.param("https://cdn.example.com@169.254.169.254/images/a.png", id="user info before another host"),
    pytest.param("https://cdn.example.com/images/../admin", id="a dot-dot segment"),
    pytest.param("https://cdn.example.com/images/%2e%2e/admin", id="an encoded dot-dot"),
    pytest.param("https://cdn.example.com/images%2f..%2fadmin", id="an encoded slash"),
    pytest.param("https://cdn.example.com\\@evil.test/images/a", id="a backslash"),
    pytest.param(" https://cdn.example.com/images/a.png", id="a leading space"),
    pytest.param("https://cdn.example.com/images/a\n.png", id="a newline"),
    pytest.param("https://cdn.example.com:8443/images/a.png", id="another port"),
    pytest.param("https://cdn.example.com.evil.test/images/a.png", id="the host as a prefix of another"),
    pytest.param("https://[::ffff:169.254.169.254]/", id="metadata as an IPv4-mapped IPv6 address"),
    pytest.param("http://[fd00:ec2::254]/latest/", id="AWS's IPv6 metadata address"),
    pytest.param("http://metadata.google.internal/computeMetadata/v1/", id="GCP's metadata host"),
    pytest.param("http://127.0.0.1:8000/metrics", id="the engine's own loopback"),
    pytest.param("http://2852039166/", id="metadata as one decimal number"),
    pytest.param("gopher://cdn.example.com/images/", id="another scheme"),
    pytest.param("https:///images/a.png", id="no host"),
    pytest.param("https://cdn.example.com:99999/images/", id="a port out of range"),
]


@pytest.mark.parametrize("url", TRICKS)
def test_urls_that_try_to_slip_past_a_prefix_are_refused(url: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        check_media_urls(image(url), ALLOWLIST)
    assert refused.value.code == "media_url_not_allowed"


PART_SHAPES = [
    pytest.param({"type": "image_url", "image_url": {"url": "U"}}, "image_url.url", id="an image part"),
    pytest.param({"type": "video_url", "video_url": {"url": "U"}}, "video_url.url", id="a video part"),
    pytest.param({"type": "audio_url", "audio_url": {"url": "U"}}, "audio_url.url", id="an audio part"),
    pytest.param({"image_url": "U"}, "image_url", id="vLLM's short form without a type"),
    pytest.param({"type": "input_image", "image_url": "U"}, "image_url", id="a Responses-style image"),
    pytest.param({"type": "file", "file": {"file_data": "U"}}, "file.file_data", id="a file given by URL"),
]


@pytest.mark.parametrize(("part", "param"), PART_SHAPES)
def test_every_url_bearing_part_is_checked(part: dict[str, Any], param: str) -> None:
    def with_url(url: str) -> list[Any]:
        filled = {key: fill(value, url) for key, value in part.items()}
        return [{"role": "user", "content": [{"type": "text", "text": "Hi"}, filled]}]

    check_media_urls(with_url("https://cdn.example.com/images/a.png"), ALLOWLIST)
    with pytest.raises(InvalidRequest) as refused:
        check_media_urls(with_url("http://169.254.169.254/"), ALLOWLIST)
    assert refused.value.param == f"messages[0].content[1].{param}"


def fill(value: Any, url: str) -> Any:
    if value == "U":
        return url
    return {key: fill(inner, url) for key, inner in value.items()} if isinstance(value, dict) else value


def test_a_stored_file_id_is_refused_and_inline_file_data_passes() -> None:
    inline = [{"role": "user", "content": [{"type": "file", "file": {"file_data": PNG, "filename": "a.png"}}]}]
    check_media_urls(inline, ())
    stored = [{"role": "user", "content": [{"type": "file", "file": {"file_id": "file-abc"}}]}]
    with pytest.raises(InvalidRequest) as refused:
        check_media_urls(stored, ())
    assert refused.value.param == "messages[0].content[0].file.file_id"


# --- the policy's entries ---------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        pytest.param("http://169.254.169.254/", "link-local", id="the metadata service, even on purpose"),
        pytest.param("http://metadata.google.internal/", "metadata host", id="a metadata host name"),
        pytest.param("https://[::1]/", "loopback", id="loopback"),
        pytest.param("https://user@cdn.example.com/", "user info", id="user info"),
        pytest.param("https://cdn.example.com/?sig=1", "no query", id="a query string"),
        pytest.param("ftp://cdn.example.com/", "scheme", id="another scheme"),
        pytest.param("cdn.example.com/images", "scheme", id="no scheme"),
    ],
)
def test_an_allowlist_entry_that_could_open_the_wrong_door_fails_the_policy_load(
    backend_server: BackendServer, entry: str, problem: str
) -> None:
    text = session_policy(backend_server.url, limits={"media_url_allowlist": [entry]})
    with pytest.raises(PolicyError) as refused:
        parse_policy(text, "policy.yaml")
    assert "media_url_allowlist" in str(refused.value)
    assert problem in str(refused.value)


# --- the Responses and Messages APIs: their own parts and blocks, the same rule ----------------

METADATA = "http://169.254.169.254/latest/meta-data/"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": METADATA}]}]},
            "input[0].content[0].image_url",
            id="responses input_image",
        ),
        pytest.param(
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_url": METADATA}]}]},
            "input[0].content[0].file_url",
            id="responses input_file",
        ),
    ],
)
def test_a_responses_part_naming_a_url_is_held_to_the_allowlist(
    start_gateway: StartGateway, backend: FakeBackend, backend_server: BackendServer, body: dict[str, Any], param: str
) -> None:
    text = session_policy(backend_server.url, limits={"media_url_allowlist": list(ALLOWLIST)})
    with (
        start_gateway(text, health_checks=False) as url,
        openai.OpenAI(base_url=f"{url}/v1", api_key=KEY_ACME, max_retries=0, timeout=10) as sdk,
        pytest.raises(openai.BadRequestError) as refused,
    ):
        sdk.responses.create(model=CHAT_MODEL, **body)
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["code"], error["param"]) == ("media_url_not_allowed", param)
    assert not backend.received


def block(source: dict[str, Any], kind: str = "image") -> list[Any]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, {"type": kind, "source": source}]}]


@pytest.mark.parametrize(
    ("messages", "code", "param"),
    [
        pytest.param(
            block({"type": "url", "url": METADATA}),
            "media_url_not_allowed",
            "messages[0].content[1].source.url",
            id="an image from the metadata service",
        ),
        pytest.param(
            block({"type": "url", "url": "https://evil.example.net/a.pdf"}, "document"),
            "media_url_not_allowed",
            "messages[0].content[1].source.url",
            id="a document from an unlisted host",
        ),
        pytest.param(
            [
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "image", "source": {"type": "url", "url": METADATA}}],
                        }
                    ],
                }
            ],
            "media_url_not_allowed",
            "messages[0].content[0].content[0].source.url",
            id="an image inside a tool result",
        ),
        pytest.param(
            block({"type": "file", "file_id": "file_1"}),
            "unsupported_field",
            "messages[0].content[1].source",
            id="a stored file",
        ),
    ],
)
def test_a_messages_block_naming_a_url_is_held_to_the_allowlist(
    start_gateway: StartGateway,
    backend: FakeBackend,
    backend_server: BackendServer,
    messages: list[Any],
    code: str,
    param: str,
) -> None:
    import anthropic

    text = session_policy(backend_server.url, limits={"media_url_allowlist": list(ALLOWLIST)})
    with (
        start_gateway(text, health_checks=False) as url,
        anthropic.Anthropic(base_url=url, api_key=KEY_ACME, max_retries=0, timeout=10) as sdk,
    ):
        with pytest.raises(anthropic.BadRequestError) as refused:
            sdk.messages.create(model=CHAT_MODEL, max_tokens=4, messages=messages)
        allowed = sdk.messages.create(
            model=CHAT_MODEL,
            max_tokens=4,
            messages=block({"type": "url", "url": "https://cdn.example.com/images/a.png"}),
        )
    error = refused.value.body
    assert isinstance(error, dict)
    assert (error["error"]["code"], error["error"]["param"]) == (code, param)
    assert allowed.type == "message"
    sent = backend.received[-1].body["messages"][-1]["content"]
    assert sent[-1] == {"type": "image_url", "image_url": {"url": "https://cdn.example.com/images/a.png"}}


# --- a tool server's URL: https to a public host ----------------------------------------------

SERVER_URLS = [
    pytest.param("https://mcp.example.com/sse", None, id="an https URL to a public name"),
    pytest.param("https://203.0.113.9:8443/mcp", "an address that is not public", id="a documentation address"),
    pytest.param("https://8.8.8.8/mcp", None, id="a public address"),
    pytest.param("http://mcp.example.com/sse", "https", id="plain http"),
    pytest.param("https://169.254.169.254/", "link-local", id="the cloud metadata address"),
    pytest.param("http://169.254.169.254/latest/meta-data/", "link-local", id="the metadata address over http"),
    pytest.param("https://[fd00:ec2::254]/", "metadata", id="AWS's IPv6 metadata address"),
    pytest.param("https://metadata.google.internal/", "metadata host", id="GCP's metadata name"),
    pytest.param("https://127.0.0.1:8080/", "loopback", id="the engine's own loopback"),
    pytest.param("https://[::ffff:10.0.0.7]/", "not public", id="a private address mapped into IPv6"),
    pytest.param("https://10.0.0.7/", "not public", id="a private address"),
    pytest.param("https://100.64.0.1/", "not public", id="a shared (carrier-grade NAT) address"),
    pytest.param("https://localhost/", "inside the engine's network", id="localhost"),
    pytest.param("https://redis:6379/", "inside the engine's network", id="a single-label cluster name"),
    pytest.param("https://vllm-0.vllm.svc/", "inside the engine's network", id="a Kubernetes service name"),
    pytest.param("https://api.svc.cluster.local/", "inside the engine's network", id="a cluster-local name"),
    pytest.param("https://mcp.example.com@169.254.169.254/", "user info", id="user info hiding the real host"),
    pytest.param("file:///etc/passwd", "scheme", id="a file URL"),
    pytest.param(5, "must be a string", id="not a string"),
]


@pytest.mark.parametrize(("url", "problem"), SERVER_URLS)
def test_a_tool_server_must_be_https_to_a_public_host(url: Any, problem: str | None) -> None:
    if problem is None:
        check_server_url(url, "tools[0].server_url")
        return
    with pytest.raises(InvalidRequest) as refused:
        check_server_url(url, "tools[0].server_url")
    assert refused.value.param == "tools[0].server_url"
    assert refused.value.code == ("invalid_field" if not isinstance(url, str) else "server_url_not_allowed")
    assert problem in refused.value.message
