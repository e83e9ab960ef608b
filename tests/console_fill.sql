-- 1,000,000 keys over 72 hours, for tests/test_console_scale.py (see its docstring).
INSERT INTO idempotency_keys (
    scope, operation, idempotency_key, operation_version, request_method, request_path,
    request_params, fingerprint, recovery_point, state, locked_at, lock_token, attempts,
    next_attempt_at, last_error, response_status, response_headers, response_body,
    created_at, last_run_at, finished_at, abandoned_at)
SELECT 'user-' || mod(n, 10000), 'op' || mod(n, 3), 'key-' || n, 1, 'POST', '/rides',
       jsonb_build_object('origin', 'Pier ' || mod(n, 97), 'amount', mod(n, 5000)), 'fp',
       CASE WHEN u THEN 'reserved' WHEN a THEN 'charged' ELSE 'finished' END,
       CASE WHEN u THEN '{}'::jsonb ELSE jsonb_build_object('ride_id', n) END,
       CASE WHEN live THEN now() END, CASE WHEN live THEN gen_random_uuid() END,
       CASE WHEN u OR a THEN 3 ELSE 1 END,
       CASE WHEN u AND mod(n, 1000) = 1 THEN now() + interval '1 minute' ELSE at + interval '1 minute' END,
       CASE WHEN u OR a THEN 'RuntimeError: payments API down' END,
       CASE WHEN u THEN NULL WHEN a THEN 500 ELSE 201 END,
       CASE WHEN u THEN NULL ELSE '{}'::jsonb END,
       CASE WHEN u THEN NULL WHEN a THEN '{"error": "request_abandoned"}'::jsonb
            ELSE jsonb_build_object('ride_id', n) END,
       at, at, CASE WHEN NOT u THEN at + interval '1 second' END,
       CASE WHEN a THEN at + interval '1 second' END
FROM (
    SELECT n, now() - (1000000 - n) * interval '259 milliseconds' AS at,
           mod(n, 250) = 1 AS u, mod(n, 200) = 0 AS a, mod(n, 5000) = 1 AS live
    FROM generate_series(1, 1000000) AS n
) AS s;
