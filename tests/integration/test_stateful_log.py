"""The event-sourcing invariant end to end, by a hypothesis state machine driving the real service.

The app runs in-process (its lifespan: pool, listener, group commit) on the test's database, reached over
ASGI; two organizations at once. Rules: submit (priorities, kinds, shapes, ``not_before``, ``depends_on``,
idempotency keys, batches with links), pair nodes and heartbeat them (a CPU node, a CPU+GPU node), claim
(``max``, ``?kind=``), renew, complete (and ``?claim_next=true``), fail (retryable or not), give back, split into children, cancel,
retry, reprioritize, drain / cordon / uncordon / retire / revoke / go offline, and move the database clock
and sweep (leases end, nodes go stale, delayed and waiting jobs are released).

The clock is ``umbra.clock_offset``: set for the database (new sessions), the app's pool drained so each
pooled connection takes it, and set on the test's own connection, which holds the sweeper's leadership
lock so that the test alone sweeps, at the moments it chooses.

After every step:

* ``POST /v1/projections/verify`` of each organization: ok, no differences;
* each organization's log read page by page from ``after=0``: positions strictly increasing, no
  duplicate, every event of that organization's own jobs and nodes, and the read before it a prefix of it;
* each job's history, read from the log, follows the lifecycle (no event after an end but a retry, no
  claim while a run stands: never two holders), and the Job objects agree with a reference model of the
  contract: the outcome of each report (holder or not, cancelled), attempts counted at claims, retries
  charged against ``max_attempts`` and interruptions not, the job a claim takes (lowest priority, then
  submission, among those due and eligible for that node), leases ended by the sweeper exactly when
  they ran out;
* another organization's jobs and nodes are 404 to each.

At the end of each example each job's and node's own history is its stream's part of the log; at the end
of the run ``umbra verify`` (every organization, on the database itself) finds nothing.

``UMBRA_STATEFUL_EXAMPLES`` / ``UMBRA_STATEFUL_STEPS`` ask for longer runs (150 × 40: about 8 minutes);
``UMBRA_STATEFUL_NO_SHRINK=1`` reports the first failure as found. The suite's own run is derandomized (the
same histories every time: a failure is the code's, not the draw's); a longer run asked for draws new ones.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import anyio
import anyio.from_thread
import httpx
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test
from psycopg import conninfo, sql

from tests.helpers import bearer
from umbra.api.app import create_app
from umbra.cli import main
from umbra.compute.accounts import create_organization
from umbra.compute.sweeper import SWEEPER_LOCK_KEY, sweep_once
from umbra.settings import load_settings

EXAMPLES = int(os.environ.get("UMBRA_STATEFUL_EXAMPLES", "12"))
STEPS = int(os.environ.get("UMBRA_STATEFUL_STEPS", "30"))

TERMINAL = {"complete", "failed", "cancelled", "partial"}
CPU = {"kind": "cpu", "label": "cpu", "vram_total_mb": 0, "vram_free_mb": 0, "ram_total_mb": 65536,
       "ram_free_mb": 60000, "throughput_factor": 1.0, "accelerators": [], "resident_models": []}  # fmt: skip
GPU = {"kind": "gpu_discrete", "label": "gpu0", "vram_total_mb": 24576, "vram_free_mb": 24000, "ram_total_mb": 0,
       "ram_free_mb": 0, "throughput_factor": 10.0, "accelerators": ["cuda"], "resident_models": []}  # fmt: skip
DEVICES = {"cpu": [CPU], "gpu": [CPU, GPU]}
#: Requirement shapes: anything, a CUDA device, more VRAM than any card has.
SHAPES = {"any": {}, "cuda": {"accelerators": ["cuda"]}, "never": {"vram_min_mb": 999_999}}


def pick(data, items: list):
    """One of ``items``, drawn the same way whatever their number: the draws never depend on what the service
    answered (hypothesis requires the data drawn to depend on the choices made alone)."""
    return items[data.draw(st.integers(0, 255)) % len(items)]


def ts(value: str | None) -> datetime | None:
    return None if value is None else datetime.fromisoformat(value.replace("Z", "+00:00"))


@dataclass
class JobModel:
    id: str
    org: int
    seq: int
    kind: str
    shape: str
    priority: int
    budget: int  #: runs granted (at submission, or by the last retry)
    submitted: int = 0  #: ``max_attempts`` as submitted: what a retry grants by default
    parent: str | None = None
    deps: list[str] = field(default_factory=list)
    children: list[str] = field(default_factory=list)
    charged: int = 0  #: runs charged against the budget since it was granted
    interrupted: int = 0  #: runs cut short from outside (give-backs, revocations) since then
    job: dict = field(default_factory=dict)  #: the Job object as last read

    @property
    def status(self) -> str:
        return self.job["status"]


@dataclass
class NodeModel:
    id: str
    org: int
    name: str
    credential: str
    devices: str  #: "cpu" or "gpu"
    stored: str = "online"
    revoked: bool = False
    cordoned: set = field(default_factory=set)


@dataclass
class Claim:
    """A claim as its agent believes it stands (stale ones too: fencing is exercised with them)."""

    job: str
    node: str
    attempt: int


class Harness:
    """The app in a blocking portal's event loop, with an ASGI client and the test's own connection."""

    def __init__(self, db_url: str) -> None:
        self.db_url = db_url
        self.dbname = conninfo.conninfo_to_dict(db_url)["dbname"]
        self.clock = 0
        self.examples = 0

    def call(self, fn, *args):
        return self.portal.call(fn, *args)


class LogMachine(RuleBasedStateMachine):
    h: Harness

    def __init__(self) -> None:
        super().__init__()
        self.h.examples += 1
        self.orgs: list[tuple[str, str]] = []
        self.jobs: dict[str, JobModel] = {}
        self.nodes: dict[str, NodeModel] = {}
        self.claims: list[Claim] = []
        #: (job, attempt) -> (node, what its report recorded): a report sent again is answered as the first was.
        self.reported: dict[tuple[str, int], tuple[str, str]] = {}
        self.seq = 0
        self.seen_log: list[list[int]] = [[], []]
        self.keys_used: list[dict[str, str]] = [{}, {}]
        # A source address of its own per example: pairing redemptions are rate-limited per address.
        self.client = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.h.app, client=(f"10.9.{self.h.examples % 250}.1", 1000)),
                                        base_url="http://umbra.test", timeout=30)  # fmt: skip

    def run(self, fn, *args):
        return self.h.call(fn, *args)

    def teardown(self) -> None:
        if self.orgs:
            self.run(self.histories_agree)
        self.run(self.client.aclose)

    # -- plumbing ------------------------------------------------------------------------------------

    async def req(self, method: str, path: str, token: str, **kwargs) -> httpx.Response:
        answer = await self.client.request(method, path, headers=bearer(token), **kwargs)
        return answer

    def key(self, org: int) -> str:
        return self.orgs[org][1]

    async def now(self) -> datetime:
        return (await (await self.h.conn.execute("SELECT umbra_now()")).fetchone())[0]

    async def refresh(self) -> None:
        """Read every job of both organizations (``GET /v1/jobs``, page by page) into the model."""
        for org in (0, 1):
            after = "0"
            while True:
                page = await self.req("GET", "/v1/jobs", self.key(org), params={"limit": 20, "after": after})
                assert page.status_code == 200, page.text
                body = page.json()
                for job in body["jobs"]:
                    assert job["organization_id"] == self.orgs[org][0], job
                    model = self.jobs.get(job["id"])
                    assert model is not None and model.org == org, ("a job the model never saw", job)
                    self.observe(model, job)
                if body["next"] is None:
                    break
                after = body["next"]

    def observe(self, model: JobModel, job: dict) -> None:
        """Take a Job object read from the API: what may never change between two reads."""
        before = model.job
        if before:
            assert job["attempt"] >= before["attempt"], (before, job)
            if before["status"] in TERMINAL and job["status"] != before["status"]:
                assert (before["status"], job["status"]) in {("failed", "queued"), ("failed", "blocked")}, (before, job)
        if job["status"] == "running" and not model.children:
            assert job["lease_owner"] is not None and job["lease_expires_at"] is not None, job
            owner = self.nodes.get(job["lease_owner"])
            assert owner is not None and owner.org == model.org, ("held by another organization's node", job)
        if job["status"] in ("queued", "blocked"):
            assert job["lease_owner"] is None and job["lease_expires_at"] is None, job
        model.job = job

    def expect(self, response: httpx.Response, status: int, error: str | None = None) -> dict | None:
        assert response.status_code == status, (response.request.method, str(response.request.url), status, error,
                                                response.status_code, response.text)  # fmt: skip
        if error is not None:
            assert response.json()["error"] == error, response.text
        return response.json() if response.content else None

    # -- set-up --------------------------------------------------------------------------------------

    @initialize()
    def organizations(self) -> None:
        async def make():
            for i in (0, 1):
                org_id, key = await create_organization(self.h.conn, f"sm{self.h.examples}-{i}")
                self.orgs.append((str(org_id), key))

        self.run(make)
        # A node each to start with (more are paired as the machine goes): claims have somewhere to land.
        self.pair(0, "cpu")
        self.pair(1, "gpu")

    # -- fleet ---------------------------------------------------------------------------------------

    @precondition(lambda self: len(self.nodes) < 5)
    @rule(org=st.integers(0, 1), devices=st.sampled_from(["cpu", "gpu"]))
    def pair(self, org: int, devices: str) -> None:
        async def go():
            name = f"n{len(self.nodes)}"
            issued = self.expect(await self.req("POST", "/v1/pairings", self.key(org), json={"name": name}), 201)
            redeemed = self.expect(await self.client.post("/v1/pairings/redeem", json={
                "code": issued["code"], "name": name, "agent_version": "1", "devices": DEVICES[devices]}), 201)
            node = NodeModel(redeemed["node_id"], org, name, redeemed["credential"], devices, stored="provisioning")
            self.nodes[node.id] = node
            await self._beat(node, devices)
            await self.refresh()

        self.run(go)

    async def _beat(self, node: NodeModel, devices: str) -> None:
        answer = await self.req("POST", "/v1/agent/heartbeat", node.credential,
                                json={"devices": DEVICES[devices], "agent_version": "1"})  # fmt: skip
        if node.revoked:
            self.expect(answer, 401, "unauthenticated")
            return
        body = self.expect(answer, 200)
        node.devices = devices
        if node.stored not in ("draining", "retired"):
            node.stored = "online"
        assert body["status"] == node.stored, (body, node)

    def runs(self) -> dict[str, dict]:
        """The runs that stand: each running job (not a container) as last read."""
        return {m.id: m.job for m in self.jobs.values() if m.status == "running" and not m.children}

    def runs_stand(self, before: dict[str, dict], *, but: str | None = None) -> None:
        """Every run of ``before`` still stands, unchanged (but those of node ``but``): nothing but its holder, a
        cancellation, the sweeper or a revocation ends a run."""
        for job_id, job in before.items():
            now = self.jobs[job_id].job
            if job["lease_owner"] != but:
                assert (now["status"], now["lease_owner"], now["attempt"]) == ("running", job["lease_owner"], job["attempt"]), (job, now)

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), devices=st.sampled_from(["cpu", "gpu"]))
    def heartbeat(self, data, devices: str) -> None:
        node = pick(data, sorted(self.nodes.values(), key=lambda n: n.name))

        async def go():
            running = self.runs()
            await self._beat(node, devices)
            await self.refresh()
            self.runs_stand(running)

        self.run(go)

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), action=st.sampled_from(["drain", "retire", "revoke", "cordon", "uncordon", "offline"]),
          device=st.sampled_from(["cpu", "gpu0"]))
    def fleet(self, data, action: str, device: str) -> None:
        node = pick(data, sorted(self.nodes.values(), key=lambda n: n.name))

        async def go():
            running = self.runs()
            key = self.key(node.org)
            other = self.key(1 - node.org)
            # Another organization's node is not there.
            self.expect(await self.req("POST", f"/v1/nodes/{node.id}/drain", other), 404, "node_not_found")
            if action == "offline":
                answer = await self.req("POST", "/v1/agent/offline", node.credential)
                if node.revoked:
                    self.expect(answer, 401)
                else:
                    self.expect(answer, 200)
                    if node.stored == "online":
                        node.stored = "offline"
            elif action in ("cordon", "uncordon"):
                body = {"device": device, "reason": "test"} if action == "cordon" else {"device": device}
                answer = await self.req("POST", f"/v1/nodes/{node.id}/{action}", key, json=body)
                if action == "cordon" and node.stored == "retired":
                    self.expect(answer, 409, "node_retired")
                elif device == "gpu0" and node.devices == "cpu" and not (action == "uncordon" and device in node.cordoned):
                    self.expect(answer, 404, "device_not_found")
                else:
                    self.expect(answer, 200)
                    (node.cordoned.add if action == "cordon" else node.cordoned.discard)(device)
            else:
                held = {j.id: j.job for j in self.jobs.values() if j.status == "running" and j.job.get("lease_owner") == node.id
                        and not j.children}  # fmt: skip
                now = await self.now()
                answer = await self.req("POST", f"/v1/nodes/{node.id}/{action}", key)
                if action == "drain" and node.stored == "retired":
                    self.expect(answer, 409)
                else:
                    self.expect(answer, 200)
                    node.stored = {"drain": "draining", "retire": "retired", "revoke": "retired"}[action]
                    if action == "revoke":
                        node.revoked = True
                await self.refresh()
                if action == "revoke":
                    for job_id, job in held.items():
                        model = self.jobs[job_id]
                        expired = ts(job["lease_expires_at"]) <= now
                        self.lease_ended(model, interruption=not expired)
            await self.refresh()
            self.runs_stand(running, but=node.id if action == "revoke" else None)

        self.run(go)

    # -- submissions ---------------------------------------------------------------------------------

    def pick_deps(self, data, org: int) -> list[str]:
        mine = [j.id for j in self.jobs.values() if j.org == org]
        indices = data.draw(st.lists(st.integers(0, 255), max_size=2)) if data.draw(st.sampled_from([False, False, True])) else []
        return list(dict.fromkeys(mine[i % len(mine)] for i in indices)) if mine else []

    @rule(data=st.data(), org=st.integers(0, 1), kind=st.sampled_from(["a", "b"]), shape=st.sampled_from(["any", "any", "cuda", "never"]),
          priority=st.integers(-1, 2), max_attempts=st.integers(1, 3), delay=st.sampled_from([None, None, -20, 10, 30]),
          key=st.sampled_from([None, None, None, "k1", "k2"]), foreign_dep=st.booleans())
    def submit(self, data, org, kind, shape, priority, max_attempts, delay, key, foreign_dep) -> None:
        deps = self.pick_deps(data, org)

        async def go():
            body: dict[str, Any] = {"kind": kind, "payload": {"n": self.seq}, "requires": SHAPES[shape],
                                    "priority": priority, "max_attempts": max_attempts}  # fmt: skip
            if delay is not None:
                body["not_before"] = ((await self.now()) + timedelta(seconds=delay)).isoformat()
            if deps:
                body["depends_on"] = deps
            if key is not None:
                body["idempotency_key"] = key
            others = [j.id for j in self.jobs.values() if j.org != org]
            if foreign_dep and others:
                # Another organization's job is no job at all: 404, and nothing written.
                bad = {**body, "depends_on": [*deps, others[0]], "idempotency_key": None}
                self.expect(await self.req("POST", "/v1/jobs", self.key(org), json=bad), 404, "job_not_found")
            answer = await self.req("POST", "/v1/jobs", self.key(org), json=body)
            if key is not None and key in self.keys_used[org]:
                job = self.expect(answer, 200)
                assert job["id"] == self.keys_used[org][key]
                return
            failed = [d for d in deps if self.jobs[d].status in ("failed", "cancelled", "partial")]
            if failed:
                self.expect(answer, 409, "dependency_failed")
                return
            job = self.expect(answer, 201)
            self.add_job(job, org, kind, shape, priority, max_attempts, deps)
            if key is not None:
                self.keys_used[org][key] = job["id"]
            waiting = any(self.jobs[d].status != "complete" for d in deps) or (delay is not None and delay > 0)
            if waiting or shape == "never":
                assert job["status"] == "blocked", job
            else:
                assert job["status"] in ("queued", "blocked"), job
            assert job["attempt"] == 0 and job["depends_on"] == deps, job
            await self.refresh()

        self.run(go)

    @rule(data=st.data(), org=st.integers(0, 1), kind=st.sampled_from(["a", "b"]), priority=st.integers(-1, 2),
          max_attempts=st.integers(1, 3))
    def submit_plain_too(self, data, org, kind, priority, max_attempts) -> None:
        """(Rules are drawn evenly: plain work twice as often as the rest.)"""
        self.submit(data, org, kind, "any", priority, max_attempts, None, None, False)

    @rule(data=st.data(), org=st.integers(0, 1), kind=st.sampled_from(["a", "b"]), priority=st.integers(-1, 2),
          max_attempts=st.integers(1, 3))
    def submit_plain(self, data, org, kind, priority, max_attempts) -> None:
        """Work any node can run at once, with nothing else to it."""
        self.submit(data, org, kind, "any", priority, max_attempts, None, None, False)

    def add_job(self, job: dict, org: int, kind: str, shape: str, priority: int, max_attempts: int, deps: list[str],
                parent: str | None = None) -> JobModel:  # fmt: skip
        self.seq += 1
        model = JobModel(job["id"], org, self.seq, kind, shape, priority, max_attempts, max_attempts, parent=parent, deps=deps)
        self.jobs[model.id] = model
        self.observe(model, job)
        return model

    @rule(org=st.integers(0, 1), size=st.integers(2, 3), shape=st.sampled_from(["any", "cuda"]))
    def submit_batch(self, org: int, size: int, shape: str) -> None:
        """A pipeline: each item after the first depends on the one before it (by number)."""

        async def go():
            items = [{"kind": "a", "payload": {}, "requires": SHAPES[shape], **({"depends_on": [i - 1]} if i else {})}
                     for i in range(size)]  # fmt: skip
            made = self.expect(await self.req("POST", "/v1/jobs/batch", self.key(org), json={"jobs": items}), 201)["jobs"]
            for i, job in enumerate(made):
                deps = [made[i - 1]["id"]] if i else []
                assert job["depends_on"] == deps, job
                if i:
                    assert job["status"] == "blocked", job
                self.add_job(job, org, "a", shape, 100, 3, deps)
            await self.refresh()

        self.run(go)

    # -- claims --------------------------------------------------------------------------------------

    def eligible(self, node: NodeModel, model: JobModel) -> bool:
        devices = {"cpu"} if node.devices == "cpu" else {"cpu", "gpu0"}
        usable = devices - node.cordoned
        if model.shape == "any":
            return bool(usable)
        if model.shape == "cuda":
            return "gpu0" in usable
        return False

    @precondition(lambda self: self.nodes)
    @rule(data=st.data(), kind=st.sampled_from([None, None, "a", "b"]), many=st.sampled_from([1, 1, 2]))
    def claim(self, data, kind: str | None, many: int) -> None:
        nodes = sorted(self.nodes.values(), key=lambda n: n.name)
        busy = {m.org for m in self.jobs.values() if m.status == "queued"}
        if data.draw(st.sampled_from([True, True, True, False])):  # mostly where there is work
            nodes = [n for n in nodes if n.org in busy and not n.revoked] or nodes
        node = pick(data, nodes)
        beat_first = data.draw(st.sampled_from([True, True, True, False]))  # as an agent does, every 10 s

        async def go():
            if beat_first and not node.revoked:
                await self._beat(node, node.devices)
            await self.refresh()
            online, ready, unsure = await self.ready_for(node, kind)
            params: dict[str, Any] = {"wait": 0}
            if kind is not None:
                params["kind"] = kind
            if many > 1:
                params["max"] = many
            answer = await self.req("POST", "/v1/agent/claim", node.credential, params=params)
            if node.revoked:
                self.expect(answer, 401, "unauthenticated")
                return
            if answer.status_code == 204:
                if online and not unsure:
                    assert not ready, ("nothing claimed with jobs ready", [m.job for m in ready], node)
                await self.refresh()
                return
            body = self.expect(answer, 200)
            assert online, ("a node not online claimed", node, body)
            claims = body.get("claims") or [body]
            taken = [c["job"] for c in claims]
            if not unsure:
                assert len(taken) == min(many, len(ready)), (len(taken), many, [m.id for m in ready])
                assert [j["id"] for j in taken] == [m.id for m in ready[: len(taken)]], (
                    [j["id"] for j in taken], [(m.id, m.job["priority"], m.seq) for m in ready])
            for one in claims:
                self.took(node, one)
            await self.refresh()

        self.run(go)

    async def ready_for(self, node: NodeModel, kind: str | None, *, but: str | None = None) -> tuple[bool, list[JobModel], bool]:
        """Whether ``node`` may claim (effectively online, stored online), the jobs it would claim in order
        (queued, due, eligible for it, of ``kind``; lowest priority first, then by submission), and whether a
        job's ``not_before`` is too close to now to tell."""
        now = await self.now()
        view = self.expect(await self.req("GET", f"/v1/nodes/{node.id}", self.key(node.org)), 200)
        if node.stored in ("draining", "retired"):
            assert view["stored_status"] == node.stored, (node, view)
        node.stored = view["stored_status"]  # the sweeper may have marked it offline

        def due(m: JobModel) -> bool | None:
            nb = ts(m.job["not_before"])
            if nb is None or nb <= now - timedelta(seconds=1):
                return True
            if nb > now + timedelta(seconds=1):
                return False
            return None  # too close to tell

        candidates = [m for m in self.jobs.values() if m.org == node.org and m.status == "queued" and m.id != but
                      and self.eligible(node, m) and (kind is None or m.kind == kind)]  # fmt: skip
        unsure = any(due(m) is None for m in candidates)
        ready = sorted((m for m in candidates if due(m)), key=lambda m: (m.job["priority"], m.seq))
        return view["status"] == "online" and node.stored == "online", ready, unsure

    def took(self, node: NodeModel, claim: dict) -> None:
        """A claim ``node`` was answered: the job was queued and eligible, is now its, one attempt on."""
        job = claim["job"]
        model = self.jobs[job["id"]]
        assert job["organization_id"] == self.orgs[node.org][0]
        assert model.status == "queued" and self.eligible(node, model), (model.job, job)
        assert job["status"] == "running" and job["lease_owner"] == node.id, job
        assert job["attempt"] == model.job["attempt"] + 1, (model.job, job)
        assert claim["placement"]["node_id"] == node.id, claim
        self.observe(model, job)
        self.claims.append(Claim(job["id"], node.id, job["attempt"]))

    # Rules are drawn evenly: the agents' side gets a second rule each, so that claims and reports are as
    # frequent as everything else together.
    @precondition(lambda self: self.nodes)
    @rule(data=st.data())
    def claim_any(self, data) -> None:
        self.claim(data, None, 1)


    # -- reports -------------------------------------------------------------------------------------

    def holds(self, c: Claim) -> bool:
        job = self.jobs[c.job].job
        return job["status"] == "running" and job["lease_owner"] == c.node and job["attempt"] == c.attempt

    def expect_refusal(self, c: Claim, answer: httpx.Response) -> None:
        job = self.jobs[c.job].job
        node = self.nodes[c.node]
        if node.revoked:
            self.expect(answer, 401)
        elif job["status"] == "cancelled" and job["lease_owner"] == c.node and job["attempt"] == c.attempt:
            self.expect(answer, 409, "job_cancelled")
        else:
            self.expect(answer, 409, "job_not_claimed_by_this_node")

    def repeats(self, c: Claim, report: str) -> bool:
        """Whether ``report`` from ``c`` repeats the report its node made of that attempt (API.md: a completion,
        failure, give-back or decomposition sent again), the job not claimed, cancelled or retried since."""
        job, node = self.jobs[c.job].job, self.nodes[c.node]
        by, recorded = self.reported.get((c.job, c.attempt), (None, None))
        if node.revoked or by != c.node or job["attempt"] != c.attempt:
            return False
        waiting, failed = job["status"] in ("queued", "blocked"), job["status"] == "failed"
        failure = (recorded == "requeued" and waiting) or (recorded == "failed" and failed and job["lease_owner"] == c.node)
        if report in ("complete", "complete_next"):
            return recorded == "completed" and job["status"] == "complete"
        if report in ("fail", "fail_for_good"):
            return failure
        if report == "give_back":
            return failure or (recorded == "released" and waiting)
        if report == "children":
            return recorded == "decomposed" and job["status"] in ("running", "complete", "partial")
        return False

    def lease_ended(self, model: JobModel, *, interruption: bool) -> None:
        """A run that ended without its holder's report: requeued while runs remain, else failed."""
        if interruption and model.interrupted < model.budget:
            model.interrupted += 1
        else:
            model.charged += 1
        expected = "failed" if model.charged >= model.budget else ("queued", "blocked")
        assert model.status in (expected if isinstance(expected, tuple) else (expected,)), (model, expected)

    @rule(data=st.data(), report=st.sampled_from(["renew", "complete", "complete_next", "fail", "fail_for_good", "give_back",
                                                  "children"]))
    def report(self, data, report: str) -> None:
        if not self.claims:
            return
        c = pick(data, self.claims)

        async def go():
            await self.refresh()
            model = self.jobs[c.job]
            node = self.nodes[c.node]
            holds = self.holds(c) and not node.revoked
            path = f"/v1/agent/jobs/{c.job}"
            if report == "renew":
                answer = await self.req("POST", f"{path}/renew", node.credential, json={"attempt": c.attempt})
            elif report in ("complete", "complete_next"):
                if report == "complete_next" and holds:
                    online, ready, unsure = await self.ready_for(node, None, but=c.job)
                answer = await self.req("POST", f"{path}/complete", node.credential, json={"attempt": c.attempt, "result": {"ok": 1}},
                                        params={"claim_next": "true"} if report == "complete_next" else None)  # fmt: skip
            elif report in ("fail", "fail_for_good"):
                answer = await self.req("POST", f"{path}/fail", node.credential,
                                        json={"attempt": c.attempt, "error": "boom", "retry": report == "fail"})  # fmt: skip
            elif report == "give_back":
                answer = await self.req("POST", f"{path}/release", node.credential, json={"attempt": c.attempt})
            else:
                kids = [{"kind": "a", "payload": {}, "requires": {}}, {"kind": "b", "payload": {}, "requires": {}, "depends_on": [0]}]
                answer = await self.req("POST", f"{path}/children", node.credential, json={"attempt": c.attempt, "children": kids})
            if not holds:
                if self.repeats(c, report):
                    # A report sent again by its node for the same attempt is answered as the first was (API.md).
                    self.expect(answer, 201 if report == "children" else 200)
                else:
                    self.expect_refusal(c, answer)
                await self.refresh()
                return
            key = (c.job, c.attempt)
            if report == "renew":
                self.expect(answer, 200)
            elif report in ("complete", "complete_next"):
                job = self.expect(answer, 200)
                assert job["status"] == "complete" and job["result"] == {"ok": 1}, job
                self.reported[key] = (c.node, "completed")
                if report == "complete_next":
                    # In the same transaction, the claim of the next job this node may take, as a claim would.
                    following = job["next_claim"]
                    if not unsure:
                        expected = ready[0].id if online and ready else None
                        assert (following and following["job"]["id"]) == expected, (following, [m.id for m in ready], online)
                    if following is not None:
                        assert online, ("a node not online claimed", node, following)
                        self.took(node, following)
            elif report == "fail_for_good":
                assert self.expect(answer, 200)["status"] == "failed"
                self.reported[key] = (c.node, "failed")
            elif report == "fail":
                job = self.expect(answer, 200)
                model.charged += 1
                if model.charged >= model.budget:
                    assert job["status"] == "failed", (model, job)
                    self.reported[key] = (c.node, "failed")
                else:
                    assert job["status"] == "queued" and ts(job["not_before"]) > await self.now(), (model, job)
                    self.reported[key] = (c.node, "requeued")
            elif report == "give_back":
                job = self.expect(answer, 200)
                if model.interrupted < model.budget:
                    model.interrupted += 1
                    assert job["status"] == "queued", (model, job)
                    self.reported[key] = (c.node, "released")
                else:
                    model.charged += 1
                    assert job["status"] == ("failed" if model.charged >= model.budget else "queued"), (model, job)
                    self.reported[key] = (c.node, "failed" if job["status"] == "failed" else "requeued")
            else:
                self.reported[key] = (c.node, "decomposed")
                made = self.expect(answer, 201)["children"]
                assert [k["parent_job_id"] for k in made] == [c.job, c.job]
                for i, kid in enumerate(made):
                    child = self.add_job(kid, model.org, kid["kind"], "any", kid["priority"], kid["max_attempts"],
                                         [made[0]["id"]] if i else [], parent=c.job)  # fmt: skip
                    model.children.append(child.id)
                assert made[1]["status"] == "blocked", made
            await self.refresh()
            if report == "renew":
                assert model.status == "running"

        self.run(go)

    @rule(data=st.data(), report=st.sampled_from(["renew", "complete", "complete_next", "fail", "give_back", "children"]))
    def report_more(self, data, report: str) -> None:
        self.report(data, report)

    # -- submitters' changes -------------------------------------------------------------------------

    @rule(data=st.data(), what=st.sampled_from(["cancel", "cancel", "retry", "priority"]), priority=st.integers(-1, 2))
    def change(self, data, what: str, priority: int) -> None:
        if not self.jobs:
            return
        model = pick(data, sorted(self.jobs.values(), key=lambda m: m.seq))

        async def go():
            await self.refresh()
            key, other = self.key(model.org), self.key(1 - model.org)
            path = f"/v1/jobs/{model.id}"
            self.expect(await self.req("GET", path, other), 404, "job_not_found")
            self.expect(await self.req("POST", f"{path}/{what}", other, json={"priority": 1} if what == "priority" else None),
                        404, "job_not_found")  # fmt: skip
            status = model.status
            if what == "cancel":
                answer = await self.req("POST", f"{path}/cancel", key)
                if status in TERMINAL:
                    self.expect(answer, 409, "job_terminal")
                else:
                    assert self.expect(answer, 200)["status"] == "cancelled"
                    await self.refresh()
                    for kid in self.descendants(model):
                        assert self.jobs[kid].status in TERMINAL, ("a cancelled job's child still open", self.jobs[kid].job)
            elif what == "retry":
                answer = await self.req("POST", f"{path}/retry", key)
                deps_bad = any(self.jobs[d].status in ("failed", "cancelled", "partial") for d in model.deps)
                if status != "failed" or model.parent or model.children or deps_bad:
                    self.expect(answer, 409, "job_not_retryable")
                else:
                    job = self.expect(answer, 200)
                    assert job["status"] in ("queued", "blocked"), job
                    model.budget, model.charged, model.interrupted = model.submitted, 0, 0
                    self.reported.pop((model.id, job["attempt"]), None)
            else:
                answer = await self.req("POST", f"{path}/priority", key, json={"priority": priority})
                if status in TERMINAL:
                    self.expect(answer, 409, "job_terminal")
                elif status == "running" or model.children:
                    self.expect(answer, 409, "job_not_reprioritizable")
                else:
                    assert self.expect(answer, 200)["priority"] == priority
            await self.refresh()

        self.run(go)

    def descendants(self, model: JobModel) -> list[str]:
        out = []
        for kid in model.children:
            out.append(kid)
            out.extend(self.descendants(self.jobs[kid]))
        return out

    # -- time ----------------------------------------------------------------------------------------

    @rule(seconds=st.sampled_from([0, 10, 10, 30, 60]))
    def advance(self, seconds: int) -> None:
        async def go():
            await self.refresh()
            if seconds:
                self.h.clock += seconds
                await self.h.set_clock(self.h.clock)
            now = await self.now()
            running = {m.id: m.job for m in self.jobs.values() if m.status == "running" and not m.children}
            await sweep_once(self.h.conn, self.h.settings, reexamine=True)
            await self.refresh()
            for job_id, before in running.items():
                model = self.jobs[job_id]
                left = ts(before["lease_expires_at"]) - now
                assert model.job["attempt"] == before["attempt"], (before, model.job)
                if model.status == "running":
                    assert left > -timedelta(seconds=1), ("a lease run out was not ended", before, model.job)
                else:  # only the sweeper acted: it ended the lease, which had run out
                    assert left < timedelta(seconds=1), ("a lease ended before its time", before, model.job)
                    self.lease_ended(model, interruption=False)

        self.run(go)

    # -- the invariants ------------------------------------------------------------------------------

    @invariant()
    def the_log_folds_to_the_views(self) -> None:
        if self.orgs:
            self.run(self.check)

    async def check(self) -> None:
        await self.refresh()
        for org in (0, 1):
            verdict = self.expect(await self.req("POST", "/v1/projections/verify", self.key(org)), 200)
            assert verdict == {"ok": True, "differences": []}, verdict
            events = await self.read_log(org)
            positions = [e["position"] for e in events]
            assert positions == sorted(set(positions)), positions
            assert positions[: len(self.seen_log[org])] == self.seen_log[org], "the log read again is not an extension of the last read"
            self.seen_log[org] = positions
            mine = {f"job:{j.id}" for j in self.jobs.values() if j.org == org} | {f"node:{n.id}" for n in self.nodes.values() if n.org == org}
            streams: dict[str, list[dict]] = {}
            for e in events:
                assert e["stream"] in mine, ("another organization's event, or one of no known object", e)
                streams.setdefault(e["stream"], []).append(e)
            for stream, history in streams.items():
                assert [e["version"] for e in history] == list(range(1, len(history) + 1)), (stream, history)
                if stream.startswith("job:"):
                    self.check_lifecycle(self.jobs[stream[4:]], history)
        node = list(self.nodes.values())[len(self.seen_log[0]) % len(self.nodes)]
        self.expect(await self.req("GET", f"/v1/nodes/{node.id}", self.key(1 - node.org)), 404, "node_not_found")

    async def histories_agree(self) -> None:
        """Each job's and node's own history (``/v1/jobs/{id}/events``, ``/v1/nodes/{id}/events``) is its stream's
        part of its organization's log, event for event."""
        for org in (0, 1):
            streams: dict[str, list[dict]] = {}
            for e in await self.read_log(org):
                streams.setdefault(e["stream"], []).append(e)
            objects = [("jobs", j.id) for j in self.jobs.values() if j.org == org]
            objects += [("nodes", n.id) for n in self.nodes.values() if n.org == org]
            for kind, object_id in objects:
                own = self.expect(await self.req("GET", f"/v1/{kind}/{object_id}/events", self.key(org)), 200)["events"]
                assert own == streams.get(f"{kind[:-1]}:{object_id}", []), (kind, object_id)
                self.expect(await self.req("GET", f"/v1/{kind}/{object_id}/events", self.key(1 - org)), 404)

    async def read_log(self, org: int) -> list[dict]:
        events: list[dict] = []
        after = 0
        while True:
            page = self.expect(await self.req("GET", "/v1/events", self.key(org), params={"after": after, "limit": 25}), 200)
            events.extend(page["events"])
            if not page["events"]:
                return events
            assert page["next"] == page["events"][-1]["position"], page
            after = page["next"]

    def check_lifecycle(self, model: JobModel, history: list[dict]) -> None:
        """The job's history, by an independent reading of its event types: what each may follow."""
        status = None
        claims = 0
        container = False
        for e in history:
            t = e["type"]
            types = [x["type"] for x in history]
            # A container runs nothing itself: only its settlement or a cancellation ends it.
            assert not container or t in ("job.settled", "job.cancelled"), (model.id, t, types)
            assert status not in TERMINAL or (status == "failed" and t == "job.retried"), (model.id, status, t, [x["type"] for x in history])
            if t == "job.submitted":
                assert status is None
                status = "queued"
            elif t == "job.blocked":
                assert status in ("queued", "blocked"), (status, t)
                status = "blocked"
            elif t == "job.unblocked":
                assert status == "blocked", (status, t)
                status = "queued"
            elif t == "job.claimed":
                assert status == "queued", ("claimed while not queued: two holders?", status, [x["type"] for x in history])
                status = "running"
                claims += 1
            elif t in ("job.lease_renewed",):
                assert status == "running", (status, t)
            elif t in ("job.completed", "job.requeued", "job.released", "job.lease_expired", "job.decomposed"):
                assert status == "running", (status, t, [x["type"] for x in history])
                status = {"job.completed": "complete", "job.decomposed": "running"}.get(t, "queued")
                container = t == "job.decomposed"
                if t == "job.lease_expired" and not e["data"].get("requeued", True):
                    status = "failed"
            elif t == "job.failed":
                assert status in ("running", "blocked", "queued"), (status, t)
                status = "failed"
            elif t == "job.settled":
                assert status == "running" and model.children, (status, t)
                status = e["data"]["outcome"]
            elif t == "job.cancelled":
                status = "cancelled"
            elif t == "job.retried":
                assert status == "failed"
                status = "queued"
            elif t == "job.reprioritized":
                assert status in ("queued", "blocked"), (status, t)
            else:
                raise AssertionError(f"unknown job event type {t}")
        assert claims == model.job["attempt"], (claims, model.job)
        assert status == model.status, (model.id, status, model.job, [x["type"] for x in history])


@pytest.fixture
def harness(db_url):
    h = Harness(db_url)
    h.settings = load_settings({"UMBRA_DATABASE_URL": db_url, "UMBRA_SWEEP_INTERVAL_SECONDS": "3600",
                                "UMBRA_LEASE_EXPIRED_DELAY_SECONDS": "10"})  # fmt: skip
    h.app = create_app(h.settings, db_url)
    with anyio.from_thread.start_blocking_portal(backend="asyncio") as portal:
        h.portal = portal

        async def connect():
            h.conn = await psycopg.AsyncConnection.connect(db_url, autocommit=True)
            # The test is the sweeper's leader: the app's waits for the lock, and never sweeps.
            assert (await (await h.conn.execute("SELECT pg_try_advisory_lock(%s)", (SWEEPER_LOCK_KEY,))).fetchone())[0]

        async def set_clock(seconds: int) -> None:
            await h.conn.execute(sql.SQL("ALTER DATABASE {} SET umbra.clock_offset = {}").format(
                sql.Identifier(h.dbname), sql.Literal(f"{seconds} seconds")))
            await h.conn.execute("SELECT set_config('umbra.clock_offset', %s, false)", (f"{seconds} seconds",))
            await h.app.state.services.pool.drain()

        h.set_clock = set_clock
        portal.call(connect)
        with portal.wrap_async_context_manager(h.app.router.lifespan_context(h.app)):
            yield h
        portal.call(h.conn.close)


#: Alone on a quiet machine the suite's run takes 10-15 s; beside the rest of the suite on two busy cores it
#: took more than the suite's 120 s bound per test (and hypothesis, cut off mid-example, reported that as a
#: flaky draw). The bound is for a hang, not a measure.
@pytest.mark.timeout(900)
def test_random_histories_over_http_fold_to_the_views(harness, monkeypatch, capsys):
    LogMachine.h = harness
    phases = [Phase.generate] if os.environ.get("UMBRA_STATEFUL_NO_SHRINK") else list(Phase)
    LogMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None, phases=phases,
                                            suppress_health_check=list(HealthCheck), database=None,
                                            derandomize="UMBRA_STATEFUL_EXAMPLES" not in os.environ)  # fmt: skip
    run_state_machine_as_test(LogMachine, settings=LogMachine.TestCase.settings)
    # And `umbra verify`, on the database itself, of every organization the examples made.
    monkeypatch.setenv("UMBRA_DATABASE_URL", harness.db_url)
    capsys.readouterr()
    assert main(["verify", "--json"]) == 0, capsys.readouterr()
    assert json.loads(capsys.readouterr().out) == {"ok": True, "differences": []}
