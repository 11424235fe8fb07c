"""Pairing: every answer, single use under a race, and the rate limit charged first."""

from __future__ import annotations

import anyio
import psycopg
import pytest

from umbra.compute.auth import NODE_SCOPES, VerifiedTokenCache, authenticate
from umbra.compute.pairing import ATTEMPTS_PER_WINDOW, WINDOW_SECONDS, charge_attempt, issue_pairing_code, redeem_pairing_code
from umbra.errors import Conflict, InvalidRequest, RateLimited, Unauthenticated
from umbra.events import store
from umbra.events.types import Device
from umbra.security import verify_secret

pytestmark = pytest.mark.anyio

GPU = Device(kind="gpu_discrete", label="gpu0", vram_total_mb=24576, vram_free_mb=24000, accelerators=("cuda",))


async def footprint(conn) -> tuple:
    """Everything a redemption could write, to prove a refusal wrote none of it."""
    row = await (await conn.execute(
        "SELECT (SELECT count(*) FROM events), (SELECT count(*) FROM nodes), (SELECT count(*) FROM node_credentials), "
        "(SELECT count(*) FROM pairing_codes WHERE redeemed_at IS NOT NULL)")).fetchone()
    return tuple(row)


async def redeem(conn, code, name="gpu-box", source="10.0.0.1", **kw):
    return await redeem_pairing_code(conn, code=code, name=name, source=source, **kw)


async def test_a_code_is_six_digits_stored_only_as_a_hash_and_no_node_exists_yet(conn, org):
    org_id, _ = org
    issued = await issue_pairing_code(conn, org_id, "gpu-box", ttl_seconds=600)
    assert len(issued.code) == 6 and issued.code.isdigit() and issued.node_name == "gpu-box"
    (stored,) = await (await conn.execute("SELECT code_hash FROM pairing_codes")).fetchall()
    assert issued.code not in stored[0] and verify_secret(stored[0], issued.code)
    assert stored[0].startswith("$argon2id$")
    assert await footprint(conn) == (0, 0, 0, 0)


@pytest.mark.parametrize("ttl", [59, 1801])
async def test_the_lifetime_is_bounded(conn, org, ttl):
    with pytest.raises(InvalidRequest):
        await issue_pairing_code(conn, org[0], "gpu-box", ttl_seconds=ttl)


@pytest.mark.parametrize("ttl", [60, 1800, None])
async def test_a_code_lives_for_its_lifetime_from_60_to_1800_seconds_600_by_default(conn, org, ttl):
    """Both bounds are accepted; the code expires that many seconds after it was issued (database clock)."""
    given = {} if ttl is None else {"ttl_seconds": ttl}
    issued = await issue_pairing_code(conn, org[0], "gpu-box", **given)
    (created,) = await (await conn.execute("SELECT created_at FROM pairing_codes WHERE id = %s", (issued.id,))).fetchone()
    assert (issued.expires_at - created).total_seconds() == (600 if ttl is None else ttl)


async def test_redeeming_creates_a_provisioning_node_and_a_four_scope_credential(conn, org):
    org_id, _ = org
    issued = await issue_pairing_code(conn, org_id, "gpu-box", trust_domain="lab", locality="rack-2")
    redeemed = await redeem(conn, issued.code, agent_version="1.0", devices=[GPU])
    assert redeemed.organization_id == org_id and set(redeemed.scopes) == set(NODE_SCOPES)
    assert set(NODE_SCOPES) == {"compute:read", "compute:heartbeat", "compute:claim", "compute:complete"}  # all four
    row = await (await conn.execute(
        "SELECT name, status, trust_domain, locality, agent_version, organization_id FROM nodes WHERE id = %s",
        (redeemed.node_id,))).fetchone()
    assert row == ("gpu-box", "provisioning", "lab", "rack-2", "1.0", org_id)
    history = await store.read_stream(conn, store.node_stream(redeemed.node_id))
    assert [r.type for r in history] == ["node.created", "node.paired"]
    assert history[1].event.devices == (GPU,)
    who = await authenticate(conn, redeemed.credential, VerifiedTokenCache())
    assert (who.kind, who.node_id, who.organization_id) == ("node", redeemed.node_id, org_id)
    assert who.scopes == frozenset(NODE_SCOPES)
    stored = (await (await conn.execute("SELECT secret_hash FROM node_credentials")).fetchone())[0]
    assert redeemed.credential not in stored


async def test_wrong_expired_and_used_codes_get_one_identical_answer(conn, org):
    org_id, _ = org
    used = await issue_pairing_code(conn, org_id, "gpu-box")
    await redeem(conn, used.code)
    expiring = await issue_pairing_code(conn, org_id, "other", ttl_seconds=60)
    before = await footprint(conn)
    answers = []
    wrong = "000000" if used.code != "000000" else "000001"
    await conn.execute("SET umbra.clock_offset = '61 seconds'")
    for code, name in [(wrong, "gpu-box"), (expiring.code, "other"), (used.code, "gpu-box"), ("12ab", "gpu-box")]:
        with pytest.raises(Unauthenticated) as refused:
            await redeem(conn, code, name=name)
        answers.append((refused.value.status, refused.value.to_json()))
    assert answers[0][1]["error"] == "pairing_code_invalid" and answers[0][0] == 401
    assert all(answer == answers[0] for answer in answers)
    assert await footprint(conn) == before


async def test_a_code_for_another_name_says_so_and_stays_usable(conn, org):
    org_id, _ = org
    issued = await issue_pairing_code(conn, org_id, "gpu-box")
    with pytest.raises(Conflict) as refused:
        await redeem(conn, issued.code, name="cpu-box")
    assert refused.value.code == "pairing_name_mismatch" and refused.value.status == 409
    assert await footprint(conn) == (0, 0, 0, 0)
    await redeem(conn, issued.code, name="gpu-box")


async def test_a_taken_name_is_refused_and_writes_nothing(conn, org):
    org_id, _ = org
    first = await issue_pairing_code(conn, org_id, "gpu-box")
    await redeem(conn, first.code)
    second = await issue_pairing_code(conn, org_id, "gpu-box")
    before = await footprint(conn)
    with pytest.raises(Conflict) as refused:
        await redeem(conn, second.code)
    assert refused.value.code == "node_name_taken"
    assert await footprint(conn) == before


async def test_the_same_name_in_another_organization_is_not_taken(conn, org):
    from umbra.compute.accounts import create_organization

    other, _ = await create_organization(conn, "globex")
    await redeem(conn, (await issue_pairing_code(conn, org[0], "gpu-box")).code)
    redeemed = await redeem(conn, (await issue_pairing_code(conn, other, "gpu-box")).code)
    assert redeemed.organization_id == other


async def test_two_redeemers_racing_on_one_code_one_wins_and_no_orphan_node(db_url, conn, org):
    issued = await issue_pairing_code(conn, org[0], "gpu-box")
    outcomes: list[str] = []

    async def redeemer(i: int):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            try:
                await redeem(c, issued.code, source=f"10.0.0.{i}")
                outcomes.append("won")
            except Unauthenticated as exc:
                outcomes.append(exc.code)

    async with anyio.create_task_group() as tg:
        for i in range(4):
            tg.start_soon(redeemer, i)
    assert sorted(outcomes) == ["pairing_code_invalid"] * 3 + ["won"]
    assert await footprint(conn) == (2, 1, 1, 1)


async def test_the_rate_limit_is_charged_before_the_code_is_checked(conn, org):
    issued = await issue_pairing_code(conn, org[0], "gpu-box")
    wrong = f"{(int(issued.code) + 1) % 1_000_000:06d}"
    for _ in range(ATTEMPTS_PER_WINDOW):
        with pytest.raises(Unauthenticated):
            await redeem(conn, wrong)
    before = await footprint(conn)
    with pytest.raises(RateLimited) as limited:
        await redeem(conn, issued.code)
    assert limited.value.status == 429 and 1 <= limited.value.retry_after <= 900
    assert await footprint(conn) == before
    # Another address has its own budget.
    await redeem(conn, issued.code, source="10.0.0.2")


async def travel(conn, seconds: int) -> None:
    """Move this session's database clock to ``seconds`` from the real now (``umbra_now``)."""
    await conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{seconds} seconds",))


async def test_the_window_slides(conn, org):
    """The last 15 minutes, whenever they began: no boundary gives a source its budget twice in a row.

    Fixed windows let 20 attempts just before a boundary and 20 just after it through within seconds.
    """
    window, half = WINDOW_SECONDS, ATTEMPTS_PER_WINDOW // 2
    for _ in range(half):
        await charge_attempt(conn, "10.0.0.9")
    await travel(conn, 600)
    for _ in range(half):
        await charge_attempt(conn, "10.0.0.9")
    for _ in range(3):  # refused attempts are not counted: they move nothing
        with pytest.raises(RateLimited) as limited:
            await charge_attempt(conn, "10.0.0.9")
        assert window - 600 - 5 <= limited.value.retry_after <= window - 600 + 1  # when the first ten leave it
    # Wherever a fixed 15-minute window would have ended, 14 minutes on the budget is still spent.
    await travel(conn, window - 60)
    with pytest.raises(RateLimited) as limited:
        await charge_attempt(conn, "10.0.0.9")
    assert 55 <= limited.value.retry_after <= 61
    # The first ten have left the window: exactly ten more are admitted, until the second ten leave too.
    await travel(conn, window + 1)
    for _ in range(half):
        await charge_attempt(conn, "10.0.0.9")
    with pytest.raises(RateLimited) as limited:
        await charge_attempt(conn, "10.0.0.9")
    assert 595 <= limited.value.retry_after <= 601
    await travel(conn, 600 + window + 1)
    await charge_attempt(conn, "10.0.0.9")
    [(kept, refused)] = await (await conn.execute(
        "SELECT cardinality(attempted_at), refused FROM pairing_attempt_times WHERE source = '10.0.0.9'")).fetchall()
    assert (kept, refused) == (half + 1, False)  # the times that left the window were dropped


async def test_concurrent_attempts_of_one_source_are_all_counted(db_url, conn, org):
    """The source's row lock orders them: of 30 at once, exactly 20 are admitted."""
    outcomes: list[str] = []

    async def attempt() -> None:
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as own:
            try:
                await charge_attempt(own, "10.0.0.7")
                outcomes.append("admitted")
            except RateLimited:
                outcomes.append("refused")

    async with anyio.create_task_group() as tg:
        for _ in range(ATTEMPTS_PER_WINDOW + 10):
            tg.start_soon(attempt)
    assert sorted(outcomes) == ["admitted"] * ATTEMPTS_PER_WINDOW + ["refused"] * 10


async def test_charging_must_commit_on_its_own(conn):
    async with conn.transaction():
        with pytest.raises(RuntimeError):
            await charge_attempt(conn, "10.0.0.1")


async def test_two_codes_for_one_name_racing_leave_one_node(db_url, conn, org):
    codes = [(await issue_pairing_code(conn, org[0], "gpu-box")).code for _ in range(2)]
    assert codes[0] != codes[1]
    outcomes: list[str] = []

    async def redeemer(code: str):
        async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as c:
            try:
                await redeem(c, code)
                outcomes.append("won")
            except Conflict as exc:
                outcomes.append(exc.code)

    async with anyio.create_task_group() as tg:
        for code in codes:
            tg.start_soon(redeemer, code)
    assert sorted(outcomes) == ["node_name_taken", "won"]
    assert await footprint(conn) == (2, 1, 1, 1)


async def test_an_attempt_costs_one_hash_however_many_codes_wait(conn, org, monkeypatch):
    """A redemption hashes the candidate once and looks it up; it never walks the waiting codes.

    With a salt per code, each wrong attempt (unauthenticated) verified the
    candidate against every live code of every organization, about 60 ms each.
    """
    from umbra.compute import pairing
    from umbra.compute.accounts import create_organization

    other, _ = await create_organization(conn, "globex")
    waiting = [await issue_pairing_code(conn, owner, f"box-{i}") for i in range(6) for owner in (org[0], other)]
    hashed: list[str] = []
    real = pairing.hash_secret_salted

    def counting(secret: str, salt: bytes) -> str:
        hashed.append(secret)
        return real(secret, salt)

    monkeypatch.setattr(pairing, "hash_secret_salted", counting)
    live = {issued.code for issued in waiting}
    wrong = next(f"{n:06d}" for n in range(1_000_000) if f"{n:06d}" not in live)
    with pytest.raises(Unauthenticated):
        await redeem(conn, wrong, name="box-0")
    assert hashed == [wrong]
    target = waiting[-1]  # the last code issued, for the other organization's "box-5"
    with pytest.raises(Conflict) as refused:
        await redeem(conn, target.code, name="box-0")
    assert refused.value.code == "pairing_name_mismatch" and "box-5" not in refused.value.message  # not told to a guesser
    assert hashed == [wrong, target.code]
    redeemed = await redeem(conn, target.code, name="box-5")
    assert redeemed.organization_id == other and hashed == [wrong, target.code, target.code]


async def test_a_fresh_code_is_never_a_live_one_of_any_name_or_organization(conn, org, monkeypatch):
    """Drawn digits that another node's code holds are drawn again; spent codes free their digits."""
    from umbra.compute import pairing
    from umbra.compute.accounts import create_organization

    draws = iter([111111, 111111, 111111, 222222, 111111])

    class Scripted:
        @staticmethod
        def randbelow(n: int) -> int:
            return next(draws)

    monkeypatch.setattr(pairing, "secrets", Scripted)
    other, _ = await create_organization(conn, "globex")
    first = await issue_pairing_code(conn, org[0], "gpu-a")
    second = await issue_pairing_code(conn, other, "gpu-b")
    assert (first.code, second.code) == ("111111", "222222")
    await redeem(conn, first.code, name="gpu-a")
    third = await issue_pairing_code(conn, other, "gpu-c")  # 111111 is spent, so no longer taken
    assert third.code == "111111"
    assert (await redeem(conn, "111111", name="gpu-c")).organization_id == other
    assert next(draws, None) is None


async def test_every_code_is_hashed_under_the_database_salt(conn, org):
    from umbra.security import hash_secret_salted

    issued = await issue_pairing_code(conn, org[0], "gpu-box")
    salt = bytes((await (await conn.execute("SELECT salt FROM pairing_salt")).fetchone())[0])
    (stored,) = (await (await conn.execute("SELECT code_hash FROM pairing_codes")).fetchone())
    assert stored == hash_secret_salted(issued.code, salt) and len(salt) == 16
    # The service role reads the salt and cannot replace it.
    await conn.execute("SET ROLE umbra_service")
    try:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            await conn.execute("UPDATE pairing_salt SET salt = %s", (bytes(16),))
    finally:
        await conn.execute("RESET ROLE")


async def test_codes_issued_before_the_hash_lookup_end_when_it_is_installed(db_url, conn, org):
    """Migration 0027: a code hashed under its own salt cannot be found by its hash, so it ends."""
    from umbra.migrate import migrate
    from umbra.security import hash_secret

    await conn.execute("DELETE FROM schema_migrations WHERE version = 27")
    await conn.execute("DROP TABLE pairing_salt")
    await conn.execute("DROP INDEX pairing_codes_by_hash")
    await conn.execute(
        "INSERT INTO pairing_codes (id, organization_id, node_name, code_hash, expires_at, created_at) "
        "VALUES (gen_random_uuid(), %s, 'old-box', %s, umbra_now() + interval '10 minutes', umbra_now())",
        (org[0], hash_secret("123456")),
    )
    assert await migrate(db_url) == ["0027_pairing_codes_by_hash.sql"]
    ended = (await (await conn.execute("SELECT expires_at <= now() FROM pairing_codes WHERE node_name = 'old-box'")).fetchone())[0]
    assert ended
    with pytest.raises(Unauthenticated):
        await redeem(conn, "123456", name="old-box")
    fresh = await issue_pairing_code(conn, org[0], "old-box")
    assert (await redeem(conn, fresh.code, name="old-box")).organization_id == org[0]


async def test_given_a_pool_pairing_holds_no_connection_while_it_hashes(db_url, conn, org, monkeypatch):
    """Each argon2id computation (about 60 ms) runs with the borrowed connection given back.

    Redemption is unauthenticated: had it held a connection through its
    hashes, a few wrong codes at once would pin the server's pool. With a pool
    of one connection, a query made in the middle of every hash must get it.
    """
    from umbra.compute import credentials, pairing
    from umbra.db import open_pool

    probed: list[str] = []

    async with open_pool(db_url, size=1) as pool:

        async def probe(what: str) -> None:
            async with pool.connection(timeout=2) as other:  # PoolTimeout if the command held it
                await other.execute("SELECT 1")
            probed.append(what)

        def probing(real, what: str):
            def hashing(*args):
                anyio.from_thread.run(probe, what)
                return real(*args)

            return hashing

        monkeypatch.setattr(pairing, "hash_secret_salted", probing(pairing.hash_secret_salted, "code"))
        monkeypatch.setattr(credentials, "hash_secret", probing(credentials.hash_secret, "credential"))
        issued = await issue_pairing_code(pool, org[0], "gpu-box")
        assert probed == ["code"]
        with pytest.raises(Unauthenticated):
            await redeem(pool, "000000" if issued.code != "000000" else "000001")
        assert probed == ["code", "code"]  # a code not found mints no credential
        redeemed = await redeem(pool, issued.code, devices=[GPU])
        assert probed == ["code", "code", "code", "credential"]
    who = await authenticate(conn, redeemed.credential, VerifiedTokenCache())
    assert (who.kind, who.node_id) == ("node", redeemed.node_id)
    attempts = (await (await conn.execute("SELECT sum(cardinality(attempted_at)) FROM pairing_attempt_times")).fetchone())[0]
    assert attempts == 2
