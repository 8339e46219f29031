"""The etcd registry URL, its credentials and TLS files, redaction and failure messages.

No etcd here: parsing (with hypothesis on user input), redaction and the classification of
etcd's refusals into specific messages. tests/relay/test_registry_etcd_live.py runs the same
paths against real etcd servers with auth and TLS.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path
from urllib.parse import quote

import pytest
from etcd3gw.exceptions import ConnectionFailedError, Etcd3Exception
from hypothesis import given
from hypothesis import strategies as st

from topkv.errors import ConfigError
from topkv.relay.registry.etcd_access import (
    DEFAULT_PREFIX,
    EtcdAccess,
    EtcdLogin,
    EtcdTLS,
    parse_etcd_url,
    redact_url,
)
from topkv.relay.registry.etcd_session import explain_failure
from topkv.relay.registry.memory import open_registry, redact_registry_url

_SECRET = "Zx9-secret"


def test_plain_url_parses_as_before() -> None:
    access = parse_etcd_url("etcd://127.0.0.1:2379", env={})
    assert access == EtcdAccess(host="127.0.0.1", port=2379, prefix=DEFAULT_PREFIX)
    assert parse_etcd_url("etcd://127.0.0.1:2379/", env={}).prefix == DEFAULT_PREFIX
    assert parse_etcd_url("etcd://h:1/cluster-a", env={}).prefix == "/cluster-a"
    assert parse_etcd_url("etcd://[::1]:2379", env={}).endpoint == "[::1]:2379"
    assert parse_etcd_url("etcd://h:1", env={}).url() == "etcd://h:1/topkv"


def test_user_with_password_from_env_file_or_url(tmp_path: Path) -> None:
    from_env = parse_etcd_url("etcd://alice@h:1", env={"TOPKV_ETCD_PASSWORD": _SECRET})
    assert from_env.login == EtcdLogin("alice", _SECRET)
    secret_file = tmp_path / "pw"
    secret_file.write_text(_SECRET + "\n")
    from_file = parse_etcd_url(
        "etcd://alice@h:1", env={"TOPKV_ETCD_PASSWORD_FILE": str(secret_file)}
    )
    assert from_file.login == EtcdLogin("alice", _SECRET)
    inline = parse_etcd_url(f"etcd://al%40ice:{quote(_SECRET + '/:@', safe='')}@h:1", env={})
    assert inline.login == EtcdLogin("al@ice", _SECRET + "/:@")
    # The URL wins over the environment; the user may come from the environment.
    env = {"TOPKV_ETCD_USER": "bob", "TOPKV_ETCD_PASSWORD": "other"}
    assert parse_etcd_url(f"etcd://alice:{_SECRET}@h:1", env=env).login == EtcdLogin(
        "alice", _SECRET
    )
    assert parse_etcd_url("etcd://h:1", env=env).login == EtcdLogin("bob", "other")
    for access in (from_env, from_file, inline):
        assert _SECRET not in repr(access) and _SECRET not in access.url()
        assert access.url().startswith(("etcd://alice@h:1", "etcd://al%40ice@h:1"))


def test_tls_files_from_query_or_env() -> None:
    access = parse_etcd_url("etcds://h:1/p?ca=/c/ca.pem&cert=/c/me.pem&key=/c/me.key", env={})
    assert access.tls == EtcdTLS("/c/ca.pem", "/c/me.pem", "/c/me.key")
    assert access.url() == "etcds://h:1/p"
    env = {"TOPKV_ETCD_CA": "/e/ca.pem", "TOPKV_ETCD_CERT": "/e/c", "TOPKV_ETCD_KEY": "/e/k"}
    assert parse_etcd_url("etcds://h:1?ca=/q/ca.pem", env=env).tls == EtcdTLS(
        "/q/ca.pem", "/e/c", "/e/k"
    )
    assert parse_etcd_url("etcds://h:1", env={}).tls == EtcdTLS()  # system trust store


@pytest.mark.parametrize(
    ("url", "env", "match"),
    [
        ("etcd://nohostport", {}, "bad etcd registry URL.*no port"),
        ("etcd://h:99999", {}, "port must be 1-65535"),
        ("etcd://h:0", {}, "no port"),
        ("etcd://:5", {}, "no host"),
        ("http://h:1", {}, "scheme must be etcd"),
        ("etcd://h:1?ca=x", {}, "TLS files are set \\(\\?ca=\\).*use etcds://"),
        ("etcd://h:1", {"TOPKV_ETCD_CA": "/ca"}, "TOPKV_ETCD_CA.*plain HTTP"),
        ("etcds://h:1?cert=c", {}, "the key .* is missing"),
        ("etcds://h:1?key=k", {}, "the cert .* is missing"),
        ("etcds://h:1?ca=a&ca=b", {}, "given twice"),
        ("etcds://h:1?cafile=a", {}, "unknown query parameter 'cafile'"),
        ("etcds://h:1?ca=", {}, "'ca' is empty"),
        ("etcd://alice@h:1", {}, "user 'alice' has no password.*TOPKV_ETCD_PASSWORD"),
        ("etcd://alice:@h:1", {}, "user 'alice' has no password"),
        ("etcd://@h:1", {}, "user before '@' is empty"),
        ("etcd://h:1", {"TOPKV_ETCD_PASSWORD": "x"}, "password is set but no etcd user"),
        (
            "etcd://a@h:1",
            {"TOPKV_ETCD_PASSWORD": "x", "TOPKV_ETCD_PASSWORD_FILE": "/f"},
            "set only one",
        ),
        ("etcd://a@h:1", {"TOPKV_ETCD_PASSWORD_FILE": "/no/such/file"}, "cannot read"),
        (f"etcd://a:{_SECRET}#x@h:1", {}, "'#' is not allowed"),
        (f"etcd://a:{_SECRET}/x@h:1", {}, "port is not a number"),
    ],
)
def test_bad_settings_are_specific_and_keep_the_password_out(
    url: str, env: dict[str, str], match: str
) -> None:
    with pytest.raises(ConfigError, match=match) as caught:
        parse_etcd_url(url, env=env)
    assert _SECRET not in str(caught.value)


def test_empty_password_file(tmp_path: Path) -> None:
    (tmp_path / "pw").write_text("\n")
    with pytest.raises(ConfigError, match=r"password file .* is empty"):
        parse_etcd_url("etcd://a@h:1", env={"TOPKV_ETCD_PASSWORD_FILE": str(tmp_path / "pw")})


def test_redact_url() -> None:
    assert redact_url(f"etcd://alice:{_SECRET}@h:1/p?ca=x") == "etcd://alice:***@h:1/p?ca=x"
    assert redact_url("etcd://alice@h:1") == "etcd://alice@h:1"
    assert redact_url("etcd://h:1") == "etcd://h:1"
    assert redact_url(f"etcd://al/ce:{_SECRET}@h:1") == "etcd://***:***@h:1"
    assert redact_url(f"alice:{_SECRET}@h") == "***"
    assert redact_registry_url(f"etcds://u:{_SECRET}@h:1") == "etcds://u:***@h:1"


def test_open_registry_keeps_passwords_out_of_errors() -> None:
    with pytest.raises(ConfigError, match="unknown registry") as caught:
        open_registry(f"zookeeper://u:{_SECRET}@h:1")
    assert _SECRET not in str(caught.value)
    with pytest.raises(ConfigError, match="bad etcd registry URL") as caught:
        open_registry(f"etcds://u:{_SECRET}@h")
    assert _SECRET not in str(caught.value)


def test_tls_check_names_the_bad_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"CA file '/no/ca\.pem' .*TOPKV_ETCD_CA"):
        EtcdTLS(ca_file="/no/ca.pem").check()
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    with pytest.raises(ConfigError, match="no usable PEM certificate"):
        EtcdTLS(ca_file=str(junk)).check()
    with pytest.raises(ConfigError, match=r"client key '/no/key' .*TOPKV_ETCD_KEY"):
        EtcdTLS(cert_file=str(junk), key_file="/no/key").check()
    with pytest.raises(ConfigError, match="do not load as a pair"):
        EtcdTLS(cert_file=str(junk), key_file=str(junk)).check()
    EtcdTLS().check()  # nothing given: the system trust store


def _etcd_refusal(message: str, code: int) -> Etcd3Exception:
    body = f'{{"error":"etcdserver: {message}","message":"etcdserver: {message}","code":{code}}}'
    return Etcd3Exception(body, "Bad Request")


@pytest.mark.parametrize(
    ("exc", "login", "tls", "match"),
    [
        (_etcd_refusal("user name is empty", 3), None, None, "no credentials.*USER@"),
        (_etcd_refusal("permission denied", 7), EtcdLogin("bob", _SECRET), None, "user 'bob'"),
        (_etcd_refusal("invalid auth token", 16), EtcdLogin("a", _SECRET), None, "auth token"),
        (_etcd_refusal("too many requests", 8), None, None, "writing.*too many requests"),
        (
            ConnectionFailedError(
                "SSLError(SSLCertVerificationError(1, '[SSL: CERTIFICATE_VERIFY_FAILED] "
                "certificate verify failed: unable to get local issuer certificate (_ssl.c:1006)'"
            ),
            None,
            EtcdTLS(ca_file="/ca.pem"),
            r"TLS verification .* \(unable to get local issuer certificate\) .*'/ca.pem'",
        ),
        (
            ConnectionFailedError("SSLError(SSLEOFError(8, 'EOF occurred in violation'))"),
            None,
            EtcdTLS(),
            "requires a client certificate.*TOPKV_ETCD_CERT",
        ),
        (
            ConnectionFailedError("SSLError(SSLEOFError(8, 'EOF occurred in violation'))"),
            None,
            EtcdTLS(cert_file="/me.pem", key_file="/me.key"),
            "refused the client certificate '/me.pem'",
        ),
        (
            ConnectionFailedError("('Connection aborted.', RemoteDisconnected('closed'))"),
            None,
            None,
            "use etcds://",
        ),
    ],
)
def test_failures_are_explained(
    exc: Exception, login: EtcdLogin | None, tls: EtcdTLS | None, match: str
) -> None:
    error = explain_failure(
        exc,
        action="writing a worker record",
        endpoint="h:1",
        prefix="/topkv/workers/",
        login=login,
        tls=tls,
    )
    assert error.args and _SECRET not in str(error)
    assert re.search(match, str(error)), str(error)


_HOSTS = st.one_of(
    st.from_regex(r"[a-z][a-z0-9-]{0,20}(\.[a-z][a-z0-9-]{0,10}){0,3}", fullmatch=True),
    st.ip_addresses(v=4).map(str),
)
_PREFIXES = st.from_regex(r"(/[a-z0-9_-]{1,12}){0,3}", fullmatch=True)
_TEXT = st.text(st.characters(codec="utf-8", exclude_categories=["Cs"]), min_size=1, max_size=30)


@given(
    host=_HOSTS,
    port=st.integers(1, 65535),
    prefix=_PREFIXES,
    user=_TEXT,
    password=_TEXT,
    tls=st.booleans(),
)
def test_well_formed_urls_round_trip(
    host: str, port: int, prefix: str, user: str, password: str, tls: bool
) -> None:
    scheme = "etcds" if tls else "etcd"
    url = f"{scheme}://{quote(user, safe='')}:{quote(password, safe='')}@{host}:{port}{prefix}"
    access = parse_etcd_url(url, env={})
    assert (access.host, access.port) == (host, port)
    assert access.prefix == (prefix or DEFAULT_PREFIX)
    assert access.login == EtcdLogin(user, password)
    assert (access.tls is not None) == tls
    assert redact_url(url) == f"{scheme}://{quote(user, safe='')}:***@{host}:{port}{prefix}"


@given(
    scheme=st.sampled_from(["etcd", "etcds"]),
    user=st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    password=_TEXT.map(lambda text: "Z" + text + "Z"),
    rest=st.from_regex(r"[a-z0-9.:/?=&]{0,30}", fullmatch=True),
)
def test_an_inline_password_never_leaks(scheme: str, user: str, password: str, rest: str) -> None:
    """Unencoded, so the URL may be malformed: the password stays out of every message."""
    url = f"{scheme}://{user}:{password}@{rest}"
    assert password not in redact_url(url)
    try:
        access = parse_etcd_url(url, env={})
    except ConfigError as exc:
        assert password not in str(exc)
    else:
        assert password not in repr(access) and password not in access.url()


@given(
    url=st.one_of(
        _TEXT,
        st.sampled_from(["etcd://", "etcds://"]).flatmap(
            lambda scheme: _TEXT.map(lambda text: scheme + text)
        ),
    )
)
def test_any_text_parses_or_is_a_config_error(url: str) -> None:
    with contextlib.suppress(ConfigError):
        parse_etcd_url(url, env={})
