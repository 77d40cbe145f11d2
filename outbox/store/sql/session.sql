-- Named statements every session the project opens runs first (outbox.pinning).

-- name: pin_search_path
-- Before any other statement: names resolve in pg_catalog (then the session's own temporary
-- schema, for relations only), never in "$user" or public, where any role that may CREATE can
-- plant an overload that beats pg_catalog's wherever a call needs a cast. The call itself is
-- qualified: it runs before the path is pinned. Session-level (is_local = false): the relay,
-- console and CLI refuse a transaction pooler, and PgBouncer's session mode resets it with
-- DISCARD ALL when a client leaves.
SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', false)

-- name: pin_search_path_local
-- The same for the current transaction only: a migration run inside another tool's transaction
-- (Django, Alembic, `migrate --print`), which must not change that tool's session.
SELECT pg_catalog.set_config('search_path', 'pg_catalog, pg_temp', true)

-- name: search_path_now
-- The session's search_path, to give it back after a migration in another tool's transaction.
SELECT pg_catalog.current_setting('search_path')

-- name: restore_search_path
-- Give another tool's transaction back the search_path it had (search_path_now).
SELECT pg_catalog.set_config('search_path', %s::text, true)
