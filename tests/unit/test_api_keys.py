"""`ApiKeys` and `KeyQuota` without a server: who a presented key makes the caller, what each caller may do on a
router with API keys, admin keys, both or neither, key files and their reload, and the per-key request limit."""

from __future__ import annotations

import logging

import pytest

from pdspark.config import AuthConfig
from pdspark.errors import ConfigError, ErrorCode, RequestFailed
from pdspark.router.auth.api_keys import Access, ApiKeys, Role, bearer_token, is_loopback
from pdspark.router.auth.key_quota import KeyQuota

CLIENT, CLIENT2, ADMIN = "client-key-0123456789", "client-key-abcdefghij", "admin-key-0123456789"


def keys(host: str = "127.0.0.1", **auth) -> ApiKeys:
    return ApiKeys(AuthConfig(**auth), host)


def bearer(key: str) -> str:
    return f"Bearer {key}"


def test_bearer_tokens_are_read_as_rfc_6750_writes_them():
    assert bearer_token("Bearer abc") == "abc" and bearer_token("bearer  abc ") == "abc"
    for value in (None, "", "Bearer", "Bearer ", "Basic abc", "abc"):
        assert bearer_token(value) is None


def test_loopback_hosts():
    assert all(map(is_loopback, ("127.0.0.1", "127.0.0.2", "::1", "localhost")))
    assert not any(map(is_loopback, ("0.0.0.0", "::", "10.0.0.1", "router.example", "")))


def test_a_key_makes_its_caller():
    k = keys(api_key=(CLIENT, CLIENT2), admin_api_key=(ADMIN,))
    assert k.identify(bearer(CLIENT)).role is Role.CLIENT and k.identify(bearer(ADMIN)).role is Role.ADMIN
    ids = {k.identify(bearer(key)).key_id for key in (CLIENT, CLIENT2, ADMIN)}
    assert len(ids) == 3 and not ids & {CLIENT, CLIENT2, ADMIN, ""}  # one per key, and not the key
    wrong, missing = k.identify(bearer("nope")), k.identify(None)
    assert (wrong.role, wrong.presented, wrong.key_id) == (Role.ANONYMOUS, True, "")
    assert (missing.role, missing.presented) == (Role.ANONYMOUS, False)
    assert k.identify("Basic " + CLIENT).role is Role.ANONYMOUS  # only Bearer carries a key
    assert k.identify(bearer(CLIENT[:-1])).role is Role.ANONYMOUS  # a prefix is not the key


def refused(k: ApiKeys, authorization: str | None, access: Access) -> ErrorCode | None:
    failure = k.refusal(k.identify(authorization), access)
    return None if failure is None else failure.code


U, P = ErrorCode.UNAUTHENTICATED, ErrorCode.PERMISSION_DENIED


@pytest.mark.parametrize("auth, host, expected", [
    # {caller: (generate, list workers, manage workers)}
    ({}, "127.0.0.1", {None: (None, None, P), "x": (None, None, P)}),  # a development router
    ({}, "0.0.0.0", {None: (None, P, P)}),  # open, but reachable from elsewhere: workers stay hidden
    ({"api_key": (CLIENT,)}, "127.0.0.1", {None: (U, P, P), "x": (U, P, P), CLIENT: (None, P, P)}),
    ({"admin_api_key": (ADMIN,)}, "127.0.0.1", {None: (None, U, U), ADMIN: (None, None, None)}),
    ({"api_key": (CLIENT,), "admin_api_key": (ADMIN,)}, "0.0.0.0",
     {None: (U, U, U), "x": (U, U, U), CLIENT: (None, P, P), ADMIN: (None, None, None)}),
])
def test_what_each_caller_may_do(auth, host, expected):
    k = keys(host, **auth)
    for key, want in expected.items():
        got = tuple(refused(k, key and bearer(key), a) for a in (Access.GENERATE, Access.LIST_WORKERS,
                                                                 Access.MANAGE_WORKERS))
        assert got == want, (key, got)
        assert refused(k, key and bearer(key), Access.OPEN) is None


def message(k: ApiKeys, authorization: str | None, access: Access) -> str:
    failure = k.refusal(k.identify(authorization), access)
    assert failure is not None
    return failure.message


def test_refusals_say_what_to_do_and_never_echo_the_key():
    k = keys(api_key=(CLIENT,))
    messages = [message(k, a, access) for a in (None, bearer("wrong-key-123456"), bearer(CLIENT))
                for access in (Access.LIST_WORKERS, Access.MANAGE_WORKERS)]
    assert all("--admin-api-key" in m for m in messages)
    assert "Authorization: Bearer" in message(k, None, Access.GENERATE)
    messages.append(message(k, bearer("wrong-key-123456"), Access.GENERATE))
    both = keys(api_key=(CLIENT,), admin_api_key=(ADMIN,))
    assert "admin key" in message(both, bearer(CLIENT), Access.MANAGE_WORKERS)
    assert not [m for m in messages if "wrong-key" in m or CLIENT in m]


def test_key_files_are_read_again_on_reload(tmp_path, caplog):
    path = tmp_path / "keys"
    path.write_text(f"# clients\n{CLIENT}\n\n  {CLIENT2}  \n")
    path.chmod(0o600)
    k = keys(api_key_file=str(path), admin_api_key=(ADMIN,))
    assert k.identify(bearer(CLIENT)).role is Role.CLIENT and k.identify(bearer(CLIENT2)).role is Role.CLIENT
    assert k.identify(bearer("# clients")).role is Role.ANONYMOUS
    path.write_text(f"{CLIENT2}\n")
    k.reload()
    assert k.identify(bearer(CLIENT)).role is Role.ANONYMOUS and k.identify(bearer(CLIENT2)).role is Role.CLIENT
    # A file that would leave no key, or make an API key an admin key, is refused; the keys in use stay.
    for text in ("", f"{ADMIN}\n"):
        path.write_text(text)
        with pytest.raises(ConfigError):
            k.reload()
        assert k.identify(bearer(CLIENT2)).role is Role.CLIENT
    path.unlink()
    with pytest.raises(ConfigError, match="cannot read"):
        k.reload()
    with pytest.raises(ConfigError, match="cannot read"):
        keys(api_key_file=str(path))
    # A key file others may read is worth a warning (the warning, like every log line, holds no key).
    path.write_text(f"{CLIENT}\n")
    path.chmod(0o644)
    with caplog.at_level(logging.DEBUG):
        keys(api_key_file=str(path), admin_api_key=("short",))
    assert "readable by other users" in caplog.text and "shorter than 16" in caplog.text
    assert CLIENT not in caplog.text and "short\n" not in caplog.text


def test_a_key_quota_counts_each_key_apart():
    q = KeyQuota(2)
    q.enter("a")
    q.enter("a")
    with pytest.raises(RequestFailed) as e:
        q.enter("a")
    assert e.value.code is ErrorCode.OVERLOADED and "max_in_flight_per_key 2" in e.value.message
    q.enter("b")
    for _ in range(10):
        q.enter("")  # no key: not counted
    q.leave("a")
    q.enter("a")
    for key in ("a", "a", "b"):
        q.leave(key)
    assert (q.held("a"), q.held("b"), q._held) == (0, 0, {})
