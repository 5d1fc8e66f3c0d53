"""Chapter 06 challenge: a salt scheme that a stolen salt cannot open.

What it asks: the cache_salt a server attaches to each request, so that a tenant keeps its
own cache hits and no other tenant reaches its blocks, even one that sends a salt string it
read somewhere. Checked on the real model: documents sent as two tenants through an engine
with prefix caching, the cached tokens of each counted.
"""

from __future__ import annotations

from kvlab.workbook.exercises import _real_engine
from kvlab.workbook.exercises._common import Case, Exercise, Mismatch
from kvlab.sampling import RequestOutputKind, SamplingParams


def cache_salt_for(tenant, requested_salt):
    """The salt the server attaches to a request from the authenticated `tenant`."""
    # Derived from who sent the request, which the client cannot forge (its API key said it),
    # never from what the request body says: a salt string read in a log or a client bundle
    # then opens nothing. (A scheme may also mix the requested salt in after the tenant, to
    # split a tenant's own cache further; the check measures the property, not the form.)
    return tenant


SALT_STUB = '''def cache_salt_for(tenant, requested_salt):
    """Return the cache_salt (a str) your server attaches to a request. tenant: who sent it,
    as the server authenticated it (from the API key; the client cannot forge it), any string
    the operator registered (one tenant's name may begin with another's).
    requested_salt: the "cache_salt" the request's body carries, or None; the client chose it,
    and an attacker may have read another tenant's salt string and sent it. The check sends
    documents as two tenants on the real model and counts the cached tokens each one gets."""
    raise NotImplementedError("your turn")
'''


def _salt_value(impl, tenant, requested):
    value = impl(tenant, requested)
    if not isinstance(value, str) or not value:
        raise Mismatch("a non-empty str", repr(value))
    return value


def _salt_returns_strings(impl) -> None:
    for tenant, requested in [("tenant-a", None), ("tenant-a", "x"), ("tenant-b", "tenant-a")]:
        _salt_value(impl, tenant, requested)


def _salt_measured(impl) -> None:
    from kvlab.engine import LLM

    docs = _real_engine.prompt_ids([64] * 7, offset=3)
    sp = SamplingParams(max_tokens=1, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    with _real_engine.one_thread():
        llm = LLM(block_size=16, kv_cache_tokens=2048, max_model_len=128,
                  enable_prefix_caching=True)

        def send(doc, tenant, requested):
            prompt = {"prompt_token_ids": doc, "cache_salt": _salt_value(impl, tenant, requested)}
            return llm.generate(prompt, sp)[0].num_cached_tokens

        rows = []
        # (what happens, the victim's request, the attacker's request, whether it may hit)
        scenes = [("tenant A sends a document again", ("tenant-a", "a-secret"),
                   ("tenant-a", "a-secret"), True),
                  ("tenant B sends A's salt string, stolen", ("tenant-a", "a-secret"),
                   ("tenant-b", "a-secret"), False),
                  ("tenant B sends no salt", ("tenant-a", None), ("tenant-b", None), False),
                  ("tenant B sends A's tenant name as its salt", ("tenant-a", None),
                   ("tenant-b", "tenant-a"), False),
                  # Two (tenant, salt) pairs that run together into one string: a scheme that
                  # glues the parts (with or without a separator) lets one spell the other.
                  ("tenant 'tenant-a1' sends no salt; A had sent '1'", ("tenant-a", "1"),
                   ("tenant-a1", None), False),
                  ("tenant 'tenant' sends '-a1'; A had sent '1'", ("tenant-a", "1"),
                   ("tenant", "-a1"), False),
                  ("tenant 'tenant-a:x' sends 'y'; A had sent 'x:y'", ("tenant-a", "x:y"),
                   ("tenant-a:x", "y"), False)]
        for doc, (what, first, second, may_hit) in zip(docs, scenes):
            send(doc, *first)
            rows.append((what, send(doc, *second), may_hit))
    report = "; ".join(f"{what}: {cached} cached" for what, cached, _ in rows)
    for what, cached, may_hit in rows:
        if may_hit and cached == 0:
            raise Mismatch(f"{what}: cache hits (a tenant keeps its own reuse)",
                           "0 cached tokens", report)
        if not may_hit and cached > 0:
            raise Mismatch(f"{what}: 0 cached tokens", f"{cached} cached tokens", report
                           + ". The salt is one string hashed into the first block's key "
                           "(chapter 06): two requests whose salts are equal share blocks, "
                           "whatever parts each salt was built from")
    return report


SALT_SCHEME = Exercise(
    name="salt_scheme",
    chapter="06_cache_salt",
    title="a salt scheme a stolen salt cannot open",
    kind="challenge",
    prompt=(
        "You run the server, and you decide the cache_salt each request gets. A tenant must "
        "keep its own cache hits, and no other tenant may reach its blocks, even one who read "
        "its salt string somewhere and sends it. The check sends documents as two tenants "
        "through a real engine with prefix caching and counts the cached tokens of each."
    ),
    full_version=(
        "kvlab serve's key mode (next section) derives the salt from the API key's tenant with "
        "a server-side secret (what it does with a salt a client sends is the next section's "
        "question); vLLM itself takes the salt from the request body, so in front of vLLM it "
        "is a gateway's job. The salt "
        "closes the prefix-hit channel only: a tenant's long prefill still delays others "
        "(chapter 04), and a shared pool still evicts everyone's blocks."
    ),
    stub=SALT_STUB,
    hint=(
        "What can the attacker not choose? The requested salt is theirs to write; the tenant "
        "the server authenticated is not."
    ),
    solution=cache_salt_for,
    cases=[
        Case("a non-empty str for every request", _salt_returns_strings,
             "Return a string: the salt the engine hashes into block 0's key."),
        Case("real model: own hits kept, a stolen, guessed or look-alike salt opens nothing",
             _salt_measured,
             "Chapter 06's attack: the attacker writes the request body; the tenant comes from "
             "the API key.",
             real_model=True, timeout_s=300),
    ],
)

EXERCISES = [SALT_SCHEME]
