"""What a FastAPI application's OpenAPI says of its idempotent routes, and that it is true.

- the schema: the key header (required or not, renamed, its format), the replay headers,
  the problem answers, for single-step and phased routes, sync and async;
- schemathesis, with its default checks, over Rocket Rides and over a single-step app, the
  key generated from the schema: every answer is one the schema declares, valid keys are
  accepted, invalid ones refused, never a 500;
- a client generated from the schema (openapi-python-client) sends the key;
- hostile keys (at the limit, over it, NUL, odd Unicode) are our 400 problem, never a 500.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from docs_snippets import blocks, page
from fastapi import FastAPI, Request, Response
from fastapi.openapi.utils import get_openapi
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ConfigDict
from testclient import DEPRECATION, TestClient

import recoverypoint as rp
from recoverypoint.database import create_engine
from recoverypoint.demo.rocket_rides import api as rocket_rides
from recoverypoint.demo.rocket_rides import provider as rocket_provider
from recoverypoint.demo.rocket_rides import schema as rocket_schema
from recoverypoint.integrations import UNSCOPED
from recoverypoint.integrations._openapi import KEY_PATTERN, NOT_A_STRING_ITEM
from recoverypoint.integrations._problem import header_name
from recoverypoint.integrations.fastapi import (
    Idempotency,
    SingleStepMiddleware,
    declare_openapi,
)
from recoverypoint.migrate import upgrade

pytestmark = [
    pytest.mark.slow,  # schemathesis over the schemas
    pytest.mark.xdist_group("openapi"),  # its servers, started once for the module
]
if DEPRECATION is not DeprecationWarning:
    # schemathesis calls an ASGI app through Starlette's TestClient too. Only where Starlette
    # has a warning of its own: the floors' has none (naming it there is an error), and
    # Python's DeprecationWarning stays an error.
    pytestmark.append(
        pytest.mark.filterwarnings("ignore::starlette.exceptions.StarletteDeprecationWarning")
    )

PROBLEMS = {"400", "409", "413", "422", "423", "503"}


class Order(BaseModel):
    # Strict, and no other fields: what the schema refuses, the app refuses.
    model_config = ConfigDict(strict=True, extra="forbid")

    item: str
    quantity: int


class Detail(BaseModel):
    detail: str


# FastAPI's own answer to a body it cannot parse (not UTF-8), which it does not declare.
UNPARSED = {400: {"model": Detail, "description": "The body could not be parsed."}}


def shop(
    engine: rp.Engine,
    *,
    declared: bool = True,
    marked: bool = True,
    middleware: bool = True,
    **choices: Any,
) -> tuple[FastAPI, Idempotency]:
    """An app of four idempotent routes, single-step and phased, sync and async, and one
    that is not idempotent; with ``declared=False`` without ``declare_openapi``, with
    ``marked=False`` its sync phased route without ``@idempotency.phased()``, with
    ``middleware=False`` without its own SingleStepMiddleware (an outer app's serves it)."""
    idempotency = Idempotency(engine, **{"scope": UNSCOPED, **choices})
    orders: rp.Operation[Any] = rp.Operation(f"order_{uuid.uuid4().hex[:8]}")

    @orders.atomic_phase("finished")
    def finish(tx: rp.AtomicContext, params: Any) -> rp.Response:
        return rp.Response(201, {"order_id": tx.key_id})

    engine.register(orders)
    app = FastAPI()
    if declared:
        declare_openapi(app)
    if middleware:
        app.add_middleware(SingleStepMiddleware)
    name = uuid.uuid4().hex[:8]

    @app.post("/single", status_code=201, responses=UNPARSED)
    @idempotency.single_step(f"single_{name}")
    def single(order: Order) -> dict[str, int]:
        return {"quantity": order.quantity}

    @app.post("/single/async", status_code=201, responses=UNPARSED)
    @idempotency.single_step(f"single_async_{name}", key_required=False)
    async def single_async(order: Order) -> dict[str, int]:
        return {"quantity": order.quantity}

    def phased(request: Request, order: Order) -> Response:
        return idempotency.run(orders, request, order.model_dump())

    route = app.post("/phased", status_code=201, responses=UNPARSED)
    route(idempotency.phased()(phased) if marked else phased)

    @app.post("/phased/async", status_code=201, responses=UNPARSED)
    @idempotency.phased(key_required=False)
    async def phased_async(request: Request, order: Order) -> Response:
        return await idempotency.run_async(orders, request, order.model_dump(), key_required=False)

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok"}

    return app, idempotency


def operation(app: FastAPI, path: str) -> dict[str, Any]:
    paths = app.openapi()["paths"]
    return next(iter(paths[path].values()))  # type: ignore[no-any-return]


def key_parameter(op: dict[str, Any], name: str = "Idempotency-Key") -> dict[str, Any]:
    found = [p for p in op.get("parameters", []) if p["in"] == "header" and p["name"] == name]
    assert len(found) == 1, op.get("parameters")
    return found[0]


@pytest.mark.parametrize(
    ("path", "required"),
    [("/single", True), ("/single/async", False), ("/phased", True), ("/phased/async", False)],
)
def test_idempotent_routes_declare_the_key_the_replay_and_the_problems(
    engine: rp.Engine, path: str, required: bool
) -> None:
    app, _ = shop(engine)
    op = operation(app, path)
    key = key_parameter(op)
    assert key["required"] is required
    assert key["schema"]["pattern"] == KEY_PATTERN
    assert key["schema"]["not"] == {"pattern": NOT_A_STRING_ITEM}
    assert "255" in key["description"]

    own = op["responses"]["201"]["headers"]
    assert own["Idempotent-Replayed"]["schema"] == {"type": "string", "enum": ["true"]}
    assert ("Idempotent-Unprotected" in own) is not required

    assert set(op["responses"]) >= PROBLEMS
    components = app.openapi()["components"]["schemas"]
    for status in PROBLEMS:
        content = op["responses"][status]["content"]["application/problem+json"]
        assert content["schema"] == {"$ref": "#/components/schemas/IdempotencyProblem"}
    assert components["IdempotencyProblem"]["required"] == ["type", "title", "status", "detail"]
    for status in ("409", "503"):
        assert op["responses"][status]["headers"]["Retry-After"]["required"] is True
    # FastAPI's own 422 (a body that fails validation) is still there, beside ours.
    assert "application/json" in op["responses"]["422"]["content"]


def test_a_route_that_is_not_idempotent_declares_nothing(engine: rp.Engine) -> None:
    app, _ = shop(engine)
    op = operation(app, "/health")
    assert "parameters" not in op
    assert set(op["responses"]) == {"200"}


def test_renamed_headers_show_under_their_names(engine: rp.Engine) -> None:
    app, _ = shop(engine, key_header="X-Request-Id", replayed_header="X-Replayed")
    for path in ("/single", "/phased"):
        op = operation(app, path)
        key_parameter(op, "X-Request-Id")
        assert not [p for p in op["parameters"] if p["name"] == "Idempotency-Key"]
        assert set(op["responses"]["201"]["headers"]) == {"X-Replayed"}
        assert "X-Request-Id header" in op["responses"]["400"]["description"]


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.from_regex(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,64}", fullmatch=True))
def test_any_key_header_name_the_integration_takes_is_declared_as_it_is(
    engine: rp.Engine, name: str
) -> None:
    try:
        header_name(name, "key_header")
    except ValueError:
        return  # the integration refuses it (Content-Length...): nothing to declare
    if name.lower() == "idempotent-replayed":
        return  # the replay header's own name: refused with the default replay header
    app, _ = shop(engine, key_header=name)
    for path in ("/single", "/phased/async"):
        key_parameter(operation(app, path), name)


def test_the_schema_is_declared_once_however_often_it_is_asked_for(engine: rp.Engine) -> None:
    app, _ = shop(engine)
    first = app.openapi()
    assert app.openapi() is first
    assert len(operation(app, "/single")["parameters"]) == 1
    with TestClient(app) as client:
        assert client.get("/openapi.json").json() == first


def _warnings_of(caplog: pytest.LogCaptureFixture, app: FastAPI) -> list[str]:
    """What the integration warned of while two of each idempotent request were served."""
    order = {"item": "tea", "quantity": 1}
    with caplog.at_level("WARNING", logger="recoverypoint"), TestClient(app) as client:
        for path in ["/single", "/single/async", "/phased", "/phased/async"] * 2:
            key = {"Idempotency-Key": str(uuid.uuid4())}
            assert client.post(path, json=order, headers=key).status_code == 201
    return [r.getMessage() for r in caplog.records if r.name.startswith("recoverypoint")]


def own_openapi(app: FastAPI) -> None:
    """Give ``app`` an ``openapi`` function of its own, as FastAPI's docs show to extend it."""

    def openapi() -> dict[str, Any]:
        if not app.openapi_schema:
            app.openapi_schema = get_openapi(title="own", version="1", routes=app.routes)
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


def test_an_app_declares_its_idempotent_routes_with_nothing_written(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = shop(engine, declared=False)
    assert key_parameter(operation(app, "/single"))["required"] is True
    assert key_parameter(operation(app, "/phased/async"))["required"] is False
    assert _warnings_of(caplog, app) == []


def test_declared_twice_the_answers_are_described_once(engine: rp.Engine) -> None:
    app, _ = shop(engine)  # declare_openapi(app) as well
    bad_key = operation(app, "/single")["responses"]["400"]["description"]
    assert bad_key.count("; or ") == 1, bad_key
    assert len(operation(app, "/phased")["parameters"]) == 1


def test_an_app_with_its_own_openapi_is_warned_of_once_until_it_declares(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = shop(engine, declared=False)
    own_openapi(app)
    assert "Idempotency-Key" not in json.dumps(app.openapi())
    (warning,) = _warnings_of(caplog, app)
    assert "declare_openapi(app)" in warning
    caplog.clear()
    app, _ = shop(engine, declared=False)
    own_openapi(app)
    declare_openapi(app)  # after assigning its own
    assert key_parameter(operation(app, "/single"))["required"] is True
    assert _warnings_of(caplog, app) == []


def test_a_phased_route_left_unmarked_is_warned_of_once(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = shop(engine, marked=False)
    assert "parameters" not in operation(app, "/phased")
    (warning,) = _warnings_of(caplog, app)
    assert "shop.<locals>.phased" in warning and "@idempotency.phased()" in warning


def test_a_declared_app_and_one_without_a_schema_are_not_warned_of(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    app, _ = shop(engine)
    assert _warnings_of(caplog, app) == []
    app, _ = shop(engine, declared=False, marked=False)
    app.openapi_url = None  # as FastAPI(openapi_url=None): no schema to declare in
    assert _warnings_of(caplog, app) == []


def test_a_route_left_out_of_the_schema_is_not_warned_of(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture
) -> None:
    app, idempotency = shop(engine)
    orders: rp.Operation[Any] = rp.Operation(f"hidden_{uuid.uuid4().hex[:8]}")
    orders.atomic_phase("finished")(lambda tx, params: rp.Response(201, {}))
    engine.register(orders)

    @app.post("/hidden", status_code=201, include_in_schema=False)
    def hidden(request: Request) -> Response:
        return idempotency.run(orders, request, {})

    with caplog.at_level("WARNING", logger="recoverypoint"), TestClient(app) as client:
        answer = client.post("/hidden", headers={"Idempotency-Key": "k"})
    assert answer.status_code == 201
    assert [r for r in caplog.records if r.name.startswith("recoverypoint")] == []


@pytest.mark.parametrize("inner_openapi", ["FastAPI's", "its own"])
def test_a_mounted_app_is_judged_by_its_own_schema(
    engine: rp.Engine, caplog: pytest.LogCaptureFixture, inner_openapi: str
) -> None:
    # The middleware on the outer app, the routes in the mounted one: /sub/openapi.json is
    # the mounted app's schema, which the outer app's openapi() does not make.
    inner, _ = shop(engine, declared=False, middleware=False)
    if inner_openapi == "its own":
        own_openapi(inner)
    outer = FastAPI()
    outer.add_middleware(SingleStepMiddleware)
    outer.mount("/sub", inner)
    with caplog.at_level("WARNING", logger="recoverypoint"), TestClient(outer) as client:
        for _ in range(2):
            key = {"Idempotency-Key": str(uuid.uuid4())}
            order = {"item": "tea", "quantity": 1}
            assert client.post("/sub/single", json=order, headers=key).status_code == 201
        schema = client.get("/sub/openapi.json").json()
    warned = [r.getMessage() for r in caplog.records if r.name.startswith("recoverypoint")]
    assert len(warned) == (inner_openapi == "its own"), warned
    assert ("Idempotency-Key" in json.dumps(schema)) is (inner_openapi == "FastAPI's")


# -- the key format the schema declares is the one the integration reads --------------

_KEY_TEXT = st.one_of(
    st.from_regex(KEY_PATTERN, fullmatch=True),
    st.text(st.sampled_from('"\\;,=: ?*-.0123456789abAZ+/'), max_size=10),
    st.text(max_size=8),
)


@settings(max_examples=500)
@given(_KEY_TEXT)
def test_a_key_the_schema_allows_is_accepted_and_one_it_refuses_is_a_400(text: str) -> None:
    from recoverypoint.errors import InvalidKey
    from recoverypoint.integrations._problem import read_key

    allowed = re.fullmatch(KEY_PATTERN, text) and not re.fullmatch(NOT_A_STRING_ITEM, text)
    try:
        read_key([text])
        accepted = True
    except InvalidKey:
        accepted = False
    if allowed:
        assert accepted, text
    elif accepted:
        # Accepted beyond the schema: parameters after a quoted key, spaces around it; a
        # client built from the schema sends neither.
        assert ";" in text or text != text.strip(" "), text


# -- hostile keys through the app: our 400, never a 500 -------------------------------

_HOSTILE = st.one_of(
    st.just("k" * 255),
    st.just("k" * 256),
    st.just('"' + "k" * 255 + '"'),
    st.just('"' + "k" * 256 + '"'),
    st.text(min_size=1, max_size=300),
    st.text(st.characters(codec="latin-1"), min_size=1, max_size=40),
    st.builds(lambda a, b: f"{a}\x00{b}", st.text(max_size=5), st.text(max_size=5)),
)


@pytest.fixture
def hostile_app(engine: rp.Engine) -> Iterator[TestClient]:
    app, _ = shop(engine)
    with TestClient(app) as client:
        yield client


@settings(max_examples=60, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=_HOSTILE)
def test_a_hostile_key_is_our_400_problem_or_accepted_never_a_500(
    hostile_app: TestClient, db: sa.Engine, key: str
) -> None:
    for path in ("/single", "/phased"):
        # As a server hands it over: latin-1 bytes; what cannot be sent is not tried.
        try:
            raw = key.encode("latin-1")
        except UnicodeEncodeError:
            raw = key.encode("utf-8")
        if b"\r" in raw or b"\n" in raw:
            continue
        answer = hostile_app.post(
            path,
            json={"item": "book", "quantity": 1},
            headers=[(b"idempotency-key", raw)],  # type: ignore[list-item]
        )
        allowed = re.fullmatch(KEY_PATTERN, key) and not re.fullmatch(NOT_A_STRING_ITEM, key)
        assert answer.status_code in (201, 400), (key, answer.status_code, answer.text)
        if answer.status_code == 400:
            assert answer.headers["content-type"] == "application/problem+json"
            assert answer.json()["type"].endswith("invalid-key")
            assert not allowed, key
        elif key == key.strip(" \t") and ";" not in key:
            assert allowed, key


# -- schemathesis over Rocket Rides and over a single-step app ---------------------------


def schemathesis_failures(app: Any, max_examples: int = 25) -> list[str]:
    """What schemathesis finds wrong with ``app``, run as its command line runs it (every
    phase, its default checks), the key generated from the schema. Its pytest plugin's
    lazy schemas do not run on pytest 9.2, hence its engine."""
    pytest.importorskip("schemathesis", reason="schemathesis's releases for pytest 9 need 3.11")
    import schemathesis.engine
    from schemathesis.engine import events

    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    # No NUL in generated strings: PostgreSQL stores none, and a body holding one is a
    # 422 by design (tests/test_bad_input.py), which the positive check would call a bug.
    schema.config.generation.update(max_examples=max_examples, allow_x00=False)
    found: list[str] = []
    for event in schemathesis.engine.from_schema(schema).execute():
        if isinstance(event, events.NonFatalError | events.FatalError):
            found.append(repr(event))
        if isinstance(event, events.ScenarioFinished) and event.status != "success":
            for case_id, checks in event.recorder.checks.items():
                case = event.recorder.cases[case_id].value
                found += [
                    f"{event.recorder.label}: {c.name}: {c.failure_info and c.failure_info.failure}"
                    f" for {case.headers} {case.body!r:.200}"
                    for c in checks
                    if c.status != "success"
                ]
            if event.status != "skip" and not event.recorder.checks:
                found.append(f"{event.recorder.label}: {event.status}")
    return found


def calls_made(app: Any) -> tuple[Any, list[int]]:
    """``app``, counting the statuses it answers."""
    statuses: list[int] = []

    async def counted(scope: Any, receive: Any, send: Any) -> None:
        async def sent(message: Any) -> None:
            if message["type"] == "http.response.start" and scope["path"] != "/openapi.json":
                statuses.append(message["status"])
            await send(message)

        await app(scope, receive, sent)

    return counted, statuses


@pytest.fixture(scope="module")
def rides_db(module_database_url: str) -> Iterator[sa.Engine]:
    db = create_engine(module_database_url)
    rocket_schema.migrate(db)
    yield db
    db.dispose()


def as_a_new_user(app: Any, db: sa.Engine) -> Any:
    """Rocket Rides, each request from a user of its own (a client of its own): its key
    collides with no other case's, however often schemathesis draws the same key."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] == "/rides":
            email = f"{uuid.uuid4().hex}@example.com"
            with db.begin() as conn:
                conn.execute(
                    sa.text("INSERT INTO users (email, customer_id) VALUES (:e, :c)"),
                    {"e": email, "c": f"cus_{uuid.uuid4().hex}"},
                )
            headers = [(k, v) for k, v in scope["headers"] if k != b"authorization"]
            headers.append((b"authorization", f"Bearer {email}".encode()))
            # A client address PostgreSQL's cidr takes (the test client's is "testclient").
            scope = {**scope, "headers": headers, "client": ("127.0.0.1", 50000)}
        await app(scope, receive, send)

    return asgi


def test_rocket_rides_answers_as_its_schema_says(rides_db: sa.Engine) -> None:
    provider_app = rocket_provider.create_app(rides_db, rocket_provider.Faults())
    with TestClient(provider_app, base_url="http://provider") as provider:
        app = rocket_rides.create_app(rp.Engine(rides_db), rocket_rides.ride_operation(provider))
        counted, statuses = calls_made(as_a_new_user(app, rides_db))
        assert schemathesis_failures(counted) == []
    # It booked rides and refused keys, not only bodies.
    assert {201, 400, 422} <= set(statuses), statuses
    with rides_db.connect() as conn:
        booked = conn.execute(sa.text("SELECT count(*) FROM rides")).scalar_one()
    assert booked == statuses.count(201)


@pytest.fixture(scope="module")
def single_step_db(module_database_url: str) -> Iterator[sa.Engine]:
    db = create_engine(module_database_url)
    upgrade(db)
    yield db
    db.dispose()


def test_a_single_step_app_answers_as_its_schema_says(single_step_db: sa.Engine) -> None:
    # A scope per request: each case's key is new, however often the same one is drawn.
    app, _ = shop(rp.Engine(single_step_db), scope=lambda request: uuid.uuid4().hex)
    counted, statuses = calls_made(app)
    assert schemathesis_failures(counted) == []
    assert {201, 400, 422} <= set(statuses), statuses


# -- a client generated from the schema sends the key -----------------------------------


def generated_client(app: FastAPI, where: Path) -> str:
    """The client package openapi-python-client generates from ``app``'s OpenAPI, as a team
    that generates its clients does, importable from ``where``; its name. Nothing in it is
    told of idempotency keys but the schema."""
    (where / "openapi.json").write_text(json.dumps(app.openapi()))
    package = f"shop_client_{uuid.uuid4().hex[:8]}"
    bin_dir = Path(sys.executable).parent
    subprocess.run(
        [bin_dir / "openapi-python-client", "generate", "--path", where / "openapi.json",
         "--output-path", where / package, "--meta", "none"],
        env={**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"},
        capture_output=True, check=True, timeout=120,
    )  # fmt: skip
    return package


def test_a_client_generated_from_the_schema_sends_the_key(
    engine: rp.Engine, db: sa.Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytest.importorskip("openapi_python_client", reason="its releases for OpenAPI 3.1 need 3.11")
    app, _ = shop(engine)
    package = generated_client(app, tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    client_module = importlib.import_module(f"{package}.client")
    phased = importlib.import_module(f"{package}.api.default.phased_phased_post")
    single = importlib.import_module(f"{package}.api.default.single_single_post")
    order = importlib.import_module(f"{package}.models.order").Order(item="book", quantity=2)
    # The key is a required argument where the route requires it, named as the header.
    assert inspect.signature(phased.sync_detailed).parameters["idempotency_key"].default is (
        inspect.Parameter.empty
    )
    with pytest.raises(TypeError, match="idempotency_key"):
        single.sync_detailed(client=None, body=order)

    key = f"generated-{uuid.uuid4()}"
    with TestClient(app) as http:
        api = client_module.Client(base_url=str(http.base_url)).set_httpx_client(http)
        first = phased.sync_detailed(client=api, body=order, idempotency_key=key)
        again = phased.sync_detailed(client=api, body=order, idempotency_key=key)
    assert first.status_code == again.status_code == 201
    assert again.parsed == first.parsed and again.headers["Idempotent-Replayed"] == "true"
    with db.connect() as conn:
        stored = conn.execute(
            sa.text("SELECT count(*) FROM idempotency_keys WHERE idempotency_key = :k"),
            {"k": key},
        ).scalar_one()
    assert stored == 1


# -- what docs/how-to/http.md shows is what the app says ----------------------------------


def test_the_schema_shown_in_the_http_page_is_the_apps(
    engine: rp.Engine, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The key, the answer's headers and a problem answer, as the page's own app (its first
    block, run on this test's database) says them for its ``POST /rides``."""
    shown = [json.loads(b.body) for b in blocks(page("how-to/http.md")) if b.lang == "json"]
    example = next(b for b in blocks(page("how-to/http.md")) if b.lang == "python")
    url = engine.db.url.render_as_string(hide_password=False)
    monkeypatch.setenv("RECOVERYPOINT_DATABASE_URL", url)
    namespace: dict[str, Any] = {"__name__": "http_page"}
    exec(compile(example.body, example.where, "exec"), namespace)
    try:
        op = operation(namespace["app"], "/rides")
        answers = op["responses"]
        assert shown == [key_parameter(op), answers["200"]["headers"], answers["409"]]
    finally:
        namespace["engine"].dispose()
