CREATE TABLE public.blob_chunks (
    blob_id uuid NOT NULL,
    seq integer NOT NULL,
    data bytea NOT NULL
);

CREATE TABLE public.blobs (
    id uuid NOT NULL,
    owner_id bigint NOT NULL,
    size bigint DEFAULT 0 NOT NULL,
    complete boolean DEFAULT false NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.caller_sessions (
    owner_id bigint NOT NULL,
    id uuid NOT NULL,
    seen_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE public.fair_usage (
    group_name text NOT NULL,
    user_name text NOT NULL,
    decayed_gpu_seconds double precision DEFAULT 0 NOT NULL
);

CREATE TABLE public.functions (
    id bigint NOT NULL,
    owner_id bigint NOT NULL,
    name text NOT NULL,
    version text NOT NULL,
    visibility text DEFAULT 'private'::text NOT NULL,
    description text DEFAULT ''::text NOT NULL,
    gpus integer DEFAULT 0 NOT NULL,
    gpu_model text,
    gpu_memory_mb integer,
    timeout_s double precision,
    max_retries integer DEFAULT 2 NOT NULL,
    expected_s double precision,
    payload bytea,
    payload_blob uuid,
    payload_size bigint DEFAULT 0 NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    registered_at timestamp with time zone DEFAULT now() NOT NULL,
    gpu_share double precision DEFAULT 1 NOT NULL,
    CONSTRAINT functions_check CHECK (((payload IS NULL) <> (payload_blob IS NULL))),
    CONSTRAINT functions_check1 CHECK (((gpu_share > (0)::double precision) AND (gpu_share <= (1)::double precision) AND ((gpu_share = (1)::double precision) OR (gpus = 1)))),
    CONSTRAINT functions_gpus_check CHECK ((gpus >= 0)),
    CONSTRAINT functions_visibility_check CHECK ((visibility = ANY (ARRAY['private'::text, 'group'::text, 'cluster'::text])))
);

CREATE SEQUENCE public.functions_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.functions_id_seq OWNED BY public.functions.id;

CREATE TABLE public.group_model_quotas (
    group_name text NOT NULL,
    model text NOT NULL,
    guaranteed_gpus integer DEFAULT 0 NOT NULL,
    borrow_limit_gpus integer,
    CONSTRAINT group_model_quotas_borrow_limit_gpus_check CHECK ((borrow_limit_gpus >= 0)),
    CONSTRAINT group_model_quotas_guaranteed_gpus_check CHECK ((guaranteed_gpus >= 0)),
    CONSTRAINT group_model_quotas_model_check CHECK ((((length(model) >= 1) AND (length(model) <= 64)) AND (model !~ '[|]'::text)))
);

CREATE TABLE public.groups (
    name text NOT NULL,
    guaranteed_gpus integer DEFAULT 0 NOT NULL,
    borrow_limit_gpus integer,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT groups_borrow_limit_gpus_check CHECK ((borrow_limit_gpus >= 0)),
    CONSTRAINT groups_guaranteed_gpus_check CHECK ((guaranteed_gpus >= 0))
);

CREATE TABLE public.idempotency_keys (
    owner_id bigint NOT NULL,
    key text NOT NULL,
    request_hash bytea NOT NULL,
    invocation_ids uuid[] DEFAULT '{}'::uuid[] NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    answered_at timestamp with time zone
);

CREATE TABLE public.invocation_logs (
    invocation_id uuid NOT NULL,
    n integer NOT NULL,
    stream smallint NOT NULL,
    data bytea NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL
);

CREATE TABLE public.invocations (
    id uuid NOT NULL,
    owner_id bigint NOT NULL,
    idempotency_key text NOT NULL,
    function_name text DEFAULT ''::text NOT NULL,
    state text DEFAULT 'queued'::text NOT NULL,
    gpus integer NOT NULL,
    max_retries integer NOT NULL,
    timeout_s double precision,
    attempts integer DEFAULT 0 NOT NULL,
    epoch integer DEFAULT 0 NOT NULL,
    node_id bigint,
    gpu_indices integer[] DEFAULT '{}'::integer[] NOT NULL,
    lease_expires_at timestamp with time zone,
    payload bytea,
    payload_blob uuid,
    payload_size bigint DEFAULT 0 NOT NULL,
    result bytea,
    result_blob uuid,
    error_kind text,
    error_type text,
    error_message text,
    traceback text,
    log_count integer DEFAULT 0 NOT NULL,
    log_ack integer DEFAULT '-1'::integer NOT NULL,
    submitted_at timestamp with time zone DEFAULT now() NOT NULL,
    scheduled_at timestamp with time zone,
    delivered_at timestamp with time zone,
    started_at timestamp with time zone,
    finished_at timestamp with time zone,
    seq bigint NOT NULL,
    payload_file text,
    result_file text,
    worker_acquired_at timestamp with time zone,
    code_started_at timestamp with time zone,
    code_finished_at timestamp with time zone,
    warm boolean,
    fetched_at timestamp with time zone,
    priority integer DEFAULT 0 NOT NULL,
    gpu_model text,
    gpu_memory_mb integer,
    expected_s double precision,
    borrowed boolean DEFAULT false NOT NULL,
    preemptions integer DEFAULT 0 NOT NULL,
    preempt_at timestamp with time zone,
    preempt_reason text,
    queue_position integer,
    wait_reason text,
    function_id bigint,
    function_version text,
    arguments bytea,
    result_json bytea,
    result_json_error text,
    function_owner text,
    result_size bigint DEFAULT 0 NOT NULL,
    caller_session uuid,
    map_id uuid,
    lease_id uuid,
    queued_at timestamp with time zone,
    gpu_share double precision DEFAULT 1 NOT NULL,
    attained_gpu_s double precision DEFAULT 0 NOT NULL,
    CONSTRAINT invocations_check CHECK (((gpu_share > (0)::double precision) AND (gpu_share <= (1)::double precision) AND ((gpu_share = (1)::double precision) OR (gpus = 1)))),
    CONSTRAINT invocations_gpus_check CHECK ((gpus >= 0)),
    CONSTRAINT invocations_max_retries_check CHECK ((max_retries >= 0)),
    CONSTRAINT invocations_payload_check CHECK (((payload IS NOT NULL) OR (payload_blob IS NOT NULL) OR (payload_file IS NOT NULL))),
    CONSTRAINT invocations_state_check CHECK ((state = ANY (ARRAY['queued'::text, 'assigned'::text, 'running'::text, 'succeeded'::text, 'failed'::text, 'timed_out'::text, 'cancelled'::text])))
);

CREATE SEQUENCE public.invocations_seq_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.invocations_seq_seq OWNED BY public.invocations.seq;

CREATE TABLE public.nodes (
    id bigint NOT NULL,
    name text NOT NULL,
    gpus jsonb DEFAULT '[]'::jsonb NOT NULL,
    cpu_slots integer DEFAULT 0 NOT NULL,
    protocol_version integer DEFAULT 1 NOT NULL,
    registered_at timestamp with time zone,
    last_heartbeat timestamp with time zone,
    gpu_health jsonb DEFAULT '[]'::jsonb NOT NULL,
    health_at timestamp with time zone,
    draining boolean DEFAULT false NOT NULL,
    drain_reason text,
    warm jsonb DEFAULT '[]'::jsonb NOT NULL,
    incarnation bigint DEFAULT 0 NOT NULL,
    removed_at timestamp with time zone
);

CREATE SEQUENCE public.nodes_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.nodes_id_seq OWNED BY public.nodes.id;

CREATE TABLE public.schema_migrations (
    version integer NOT NULL,
    name text NOT NULL,
    applied_at timestamp with time zone DEFAULT clock_timestamp() NOT NULL
);

CREATE TABLE public.tokens (
    token_hash bytea NOT NULL,
    kind text NOT NULL,
    user_id bigint,
    node_id bigint,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    id bigint NOT NULL,
    name text DEFAULT ''::text NOT NULL,
    hint text DEFAULT ''::text NOT NULL,
    expires_at timestamp with time zone,
    revoked_at timestamp with time zone,
    CONSTRAINT tokens_check CHECK (((kind = 'user'::text) = (user_id IS NOT NULL))),
    CONSTRAINT tokens_check1 CHECK (((kind = 'node'::text) = (node_id IS NOT NULL))),
    CONSTRAINT tokens_kind_check CHECK ((kind = ANY (ARRAY['user'::text, 'node'::text])))
);

CREATE SEQUENCE public.tokens_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.tokens_id_seq OWNED BY public.tokens.id;

CREATE TABLE public.usage_clock (
    one boolean DEFAULT true NOT NULL,
    accrued_at timestamp with time zone DEFAULT now() NOT NULL,
    CONSTRAINT usage_clock_one_check CHECK (one)
);

CREATE TABLE public.usage_daily (
    day date NOT NULL,
    user_id bigint NOT NULL,
    group_name text NOT NULL,
    gpu_seconds double precision DEFAULT 0 NOT NULL,
    calls bigint DEFAULT 0 NOT NULL
);

CREATE TABLE public.users (
    id bigint NOT NULL,
    name text NOT NULL,
    is_admin boolean DEFAULT false NOT NULL,
    created_at timestamp with time zone DEFAULT now() NOT NULL,
    group_name text DEFAULT 'default'::text NOT NULL
);

CREATE SEQUENCE public.users_id_seq
    START WITH 1
    INCREMENT BY 1
    NO MINVALUE
    NO MAXVALUE
    CACHE 1;

ALTER SEQUENCE public.users_id_seq OWNED BY public.users.id;

ALTER TABLE ONLY public.functions ALTER COLUMN id SET DEFAULT nextval('public.functions_id_seq'::regclass);

ALTER TABLE ONLY public.invocations ALTER COLUMN seq SET DEFAULT nextval('public.invocations_seq_seq'::regclass);

ALTER TABLE ONLY public.nodes ALTER COLUMN id SET DEFAULT nextval('public.nodes_id_seq'::regclass);

ALTER TABLE ONLY public.tokens ALTER COLUMN id SET DEFAULT nextval('public.tokens_id_seq'::regclass);

ALTER TABLE ONLY public.users ALTER COLUMN id SET DEFAULT nextval('public.users_id_seq'::regclass);

ALTER TABLE ONLY public.blob_chunks
    ADD CONSTRAINT blob_chunks_pkey PRIMARY KEY (blob_id, seq);

ALTER TABLE ONLY public.blobs
    ADD CONSTRAINT blobs_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.caller_sessions
    ADD CONSTRAINT caller_sessions_pkey PRIMARY KEY (owner_id, id);

ALTER TABLE ONLY public.fair_usage
    ADD CONSTRAINT fair_usage_pkey PRIMARY KEY (group_name, user_name);

ALTER TABLE ONLY public.functions
    ADD CONSTRAINT functions_owner_id_name_version_key UNIQUE (owner_id, name, version);

ALTER TABLE ONLY public.functions
    ADD CONSTRAINT functions_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.group_model_quotas
    ADD CONSTRAINT group_model_quotas_pkey PRIMARY KEY (group_name, model);

ALTER TABLE ONLY public.groups
    ADD CONSTRAINT groups_pkey PRIMARY KEY (name);

ALTER TABLE ONLY public.idempotency_keys
    ADD CONSTRAINT idempotency_keys_pkey PRIMARY KEY (owner_id, key);

ALTER TABLE ONLY public.invocation_logs
    ADD CONSTRAINT invocation_logs_pkey PRIMARY KEY (invocation_id, n);

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_owner_id_idempotency_key_key UNIQUE (owner_id, idempotency_key);

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.nodes
    ADD CONSTRAINT nodes_name_key UNIQUE (name);

ALTER TABLE ONLY public.nodes
    ADD CONSTRAINT nodes_pkey PRIMARY KEY (id);

ALTER TABLE ONLY public.schema_migrations
    ADD CONSTRAINT schema_migrations_pkey PRIMARY KEY (version);

ALTER TABLE ONLY public.tokens
    ADD CONSTRAINT tokens_id_key UNIQUE (id);

ALTER TABLE ONLY public.tokens
    ADD CONSTRAINT tokens_pkey PRIMARY KEY (token_hash);

ALTER TABLE ONLY public.usage_clock
    ADD CONSTRAINT usage_clock_pkey PRIMARY KEY (one);

ALTER TABLE ONLY public.usage_daily
    ADD CONSTRAINT usage_daily_pkey PRIMARY KEY (day, user_id, group_name);

ALTER TABLE ONLY public.users
    ADD CONSTRAINT users_name_key UNIQUE (name);

ALTER TABLE ONLY public.users
    ADD CONSTRAINT users_pkey PRIMARY KEY (id);

CREATE INDEX blobs_created ON public.blobs USING btree (created_at);

CREATE INDEX blobs_owner ON public.blobs USING btree (owner_id);

CREATE INDEX caller_sessions_seen ON public.caller_sessions USING btree (seen_at);

CREATE INDEX functions_latest ON public.functions USING btree (owner_id, name, registered_at DESC);

CREATE INDEX functions_payload_blob ON public.functions USING btree (payload_blob) WHERE (payload_blob IS NOT NULL);

CREATE INDEX idempotency_keys_created ON public.idempotency_keys USING btree (created_at);

CREATE INDEX invocations_finished ON public.invocations USING btree (finished_at) WHERE (finished_at IS NOT NULL);

CREATE INDEX invocations_leased ON public.invocations USING btree (node_id) WHERE (state = ANY (ARRAY['assigned'::text, 'running'::text]));

CREATE INDEX invocations_owner ON public.invocations USING btree (owner_id, seq DESC);

CREATE INDEX invocations_payload_blob ON public.invocations USING btree (payload_blob) WHERE (payload_blob IS NOT NULL);

CREATE INDEX invocations_queued ON public.invocations USING btree (seq) WHERE (state = 'queued'::text);

CREATE INDEX invocations_queued_map ON public.invocations USING btree (owner_id, COALESCE(map_id, id), seq) WHERE (state = 'queued'::text);

CREATE INDEX invocations_queued_owner ON public.invocations USING btree (owner_id, seq) WHERE (state = 'queued'::text);

CREATE INDEX invocations_result_blob ON public.invocations USING btree (result_blob) WHERE (result_blob IS NOT NULL);

CREATE INDEX invocations_shared_files ON public.invocations USING btree (owner_id) WHERE ((payload_file IS NOT NULL) OR (result_file IS NOT NULL));

CREATE INDEX invocations_waited_for ON public.invocations USING btree (owner_id, caller_session) WHERE ((caller_session IS NOT NULL) AND (state = ANY (ARRAY['queued'::text, 'assigned'::text, 'running'::text])));

ALTER TABLE ONLY public.blob_chunks
    ADD CONSTRAINT blob_chunks_blob_id_fkey FOREIGN KEY (blob_id) REFERENCES public.blobs(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.blobs
    ADD CONSTRAINT blobs_owner_id_fkey FOREIGN KEY (owner_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.caller_sessions
    ADD CONSTRAINT caller_sessions_owner_id_fkey FOREIGN KEY (owner_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.functions
    ADD CONSTRAINT functions_owner_id_fkey FOREIGN KEY (owner_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.functions
    ADD CONSTRAINT functions_payload_blob_fkey FOREIGN KEY (payload_blob) REFERENCES public.blobs(id);

ALTER TABLE ONLY public.group_model_quotas
    ADD CONSTRAINT group_model_quotas_group_name_fkey FOREIGN KEY (group_name) REFERENCES public.groups(name) ON DELETE CASCADE;

ALTER TABLE ONLY public.idempotency_keys
    ADD CONSTRAINT idempotency_keys_owner_id_fkey FOREIGN KEY (owner_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.invocation_logs
    ADD CONSTRAINT invocation_logs_invocation_id_fkey FOREIGN KEY (invocation_id) REFERENCES public.invocations(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_function_id_fkey FOREIGN KEY (function_id) REFERENCES public.functions(id) ON DELETE SET NULL;

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_node_id_fkey FOREIGN KEY (node_id) REFERENCES public.nodes(id);

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_owner_id_fkey FOREIGN KEY (owner_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_payload_blob_fkey FOREIGN KEY (payload_blob) REFERENCES public.blobs(id);

ALTER TABLE ONLY public.invocations
    ADD CONSTRAINT invocations_result_blob_fkey FOREIGN KEY (result_blob) REFERENCES public.blobs(id);

ALTER TABLE ONLY public.tokens
    ADD CONSTRAINT tokens_node_id_fkey FOREIGN KEY (node_id) REFERENCES public.nodes(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.tokens
    ADD CONSTRAINT tokens_user_id_fkey FOREIGN KEY (user_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.usage_daily
    ADD CONSTRAINT usage_daily_user_id_fkey FOREIGN KEY (user_id) REFERENCES public.users(id) ON DELETE CASCADE;

ALTER TABLE ONLY public.users
    ADD CONSTRAINT users_group_name_fkey FOREIGN KEY (group_name) REFERENCES public.groups(name);
