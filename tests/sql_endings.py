"""SQL text as phase code might send it, for the tests of the phase guard: statements that
end the transaction (COMMIT, ROLLBACK, END, ABORT... in any case, with comments and odd
whitespace between their words), statements that do not but look alike (ROLLBACK TO
SAVEPOINT, a string, a comment or a dollar-quoted body that holds a COMMIT), and strings of
several statements. Each text runs without error on PostgreSQL, so the server can say
whether it ended the transaction it ran in."""

from __future__ import annotations

from hypothesis import strategies as st

SAVEPOINT = "SAVEPOINT rp_guard"

# The words of each statement that ends a transaction; PREPARE TRANSACTION needs a server
# with max_prepared_transactions > 0 to run (ENDINGS_EVEN_UNRUNNABLE adds it).
ENDING_WORDS = [
    ["COMMIT"],
    ["COMMIT", "WORK"],
    ["COMMIT", "TRANSACTION"],
    ["COMMIT", "AND", "CHAIN"],
    ["COMMIT", "AND", "NO", "CHAIN"],
    ["END"],
    ["END", "TRANSACTION"],
    ["ABORT"],
    ["ABORT", "WORK"],
    ["ROLLBACK"],
    ["ROLLBACK", "TRANSACTION"],
    ["ROLLBACK", "AND", "CHAIN"],
]
PREPARE_WORDS = [["PREPARE", "TRANSACTION", "'rp_guard'"]]

# Statements that end nothing, some of them made to fool a reader that does not know SQL's
# quoting; the ones before the first ending may use the savepoint, the others must run
# in any transaction (or in none).
HARMLESS = [
    "SELECT 1",
    "select 'x; COMMIT'",
    "SELECT 'it''s; ROLLBACK'",
    "SELECT E'\\'; COMMIT; '",
    "SELECT $$; COMMIT; $$",
    "SELECT $body$ ; end ; $body$",
    'SELECT 1 AS "commit;"',
    "SELECT 1 AS commit",
    "SELECT /* ; ROLLBACK */ 2",
    "SELECT /* nested /* ; COMMIT */ ; END */ 3",
    "SELECT 4 -- ; COMMIT\n",
    "SELECT CASE WHEN true THEN 'pending' END",
    "SELECT 1 AS begin",
    "BEGIN",  # a warning, inside a transaction
    # A body of statements, whose END is not the transaction's (PostgreSQL 14 and later)
    "CREATE OR REPLACE FUNCTION pg_temp.rp_guard() RETURNS int LANGUAGE sql BEGIN ATOMIC "
    "SELECT 1; SELECT CASE WHEN true THEN 2 END; END",
]
HARMLESS_WITH_SAVEPOINT = [
    "ROLLBACK TO SAVEPOINT rp_guard",
    "rollback to rp_guard",
    "ROLLBACK WORK TO SAVEPOINT rp_guard",
    "Rollback /* to where? */ Transaction\n-- there\nTo rp_guard",
]

_spaces = st.sampled_from([" ", "  ", "\t", "\n", " \r\n "])
_comments = st.sampled_from(["/* c */", "/* a /* nested; COMMIT */ one */", "-- c;\n", "/**/"])
_gap = st.lists(st.one_of(_spaces, _comments), min_size=1, max_size=3).map("".join)
_lead = st.lists(st.one_of(_spaces, _comments), max_size=3).map("".join)
_joiner = st.sampled_from([";", "; ", ";\n", " ;\n\t", ";;"])


@st.composite
def _any_case(draw: st.DrawFn, word: str) -> str:
    upper = draw(st.lists(st.booleans(), min_size=len(word), max_size=len(word)))
    return "".join(c.upper() if u else c.lower() for c, u in zip(word, upper, strict=True))


@st.composite
def _statement(draw: st.DrawFn, words: list[str]) -> str:
    text = draw(_lead) + draw(_any_case(words[0]))
    for word in words[1:]:
        text += draw(_gap) + draw(_any_case(word))
    return text


def ending(*, runnable: bool = True) -> st.SearchStrategy[str]:
    """One statement that ends the transaction; with ``runnable``, none that needs the
    server's prepared transactions."""
    words = ENDING_WORDS if runnable else ENDING_WORDS + PREPARE_WORDS
    return st.sampled_from(words).flatmap(_statement)


@st.composite
def texts(draw: st.DrawFn, *, ends: bool | None = None, runnable: bool = True) -> str:
    """One or more statements, joined as phase code may send them in one string: the
    savepoint, harmless statements, then (``ends``: always; ``None``: maybe) one that ends
    the transaction and harmless ones after it."""
    before = draw(st.lists(st.sampled_from(HARMLESS + HARMLESS_WITH_SAVEPOINT), max_size=3))
    statements = [SAVEPOINT, *before] if before else []
    if ends or (ends is None and draw(st.booleans())):
        statements.append(draw(ending(runnable=runnable)))
        statements += draw(st.lists(st.sampled_from(HARMLESS), max_size=2))
    elif not statements:
        statements.append(draw(st.sampled_from(HARMLESS)))
    text = statements[0]
    for statement in statements[1:]:
        text += draw(_joiner) + statement
    return text + draw(st.sampled_from(["", ";", " ;\n"]))
