/* pyfabric data path: batched RMA writes with immediates and a progress loop (S5, S4c).
 *
 * Plain declarations only: _build.py feeds this file to both cffi's cdef (which cannot
 * parse #include or macros) and the compiler, so the layouts Python sees are the real ones.
 * One worker per endpoint; only the worker's thread calls fabp_progress, any thread may call
 * fabp_submit, and a thread waiting for its own op runs the loop itself in fabp_run_waited.
 */

#define FABP_OP_IMM 1
/* The submitter waits for this op in fabp_run_waited: its first report reaches the waiter
 * through the op's own fields, never as an event. */
#define FABP_OP_WAITED 2
/* Stamp the op's phases (t_*_ns below); off, an op reads no clock for them. */
#define FABP_OP_TIMED 4

/* What fabp_run_waited returns (a negative value is a fatal CQ error). */
#define FABP_WAIT_SLICE 0    /* the slice ran out: call again */
#define FABP_WAIT_RETIRED 1  /* reported and retired: no event will ever name it */
#define FABP_WAIT_REPORTED 2 /* failed, writes still out: its retirement comes as an event */
#define FABP_WAIT_CLOSED 3   /* fabp_close_waits was called */
#define FABP_WAIT_DONE 4      /* fabp_run_prepared: retired without error */
#define FABP_WAIT_PEER_GONE 5 /* fabp_run_prepared: the shm peer's file has no links left */

/* The err of ops failed by fabp_fail_dest when the caller gave up on the peer (not an fi
 * errno: libfabric's all lie below 1000). */
#define FABP_EABANDONED 4096

/* One queued operation: n writes of len bytes, page i going from
 * src_addr + src_idx[i] * src_stride to raddr dst_addr + dst_idx[i] * dst_stride.
 * A NULL index array means "index i itself". len == 0 with FABP_OP_IMM is a pure immediate. */
struct fabp_op {
    struct fabp_op *next;
    uint64_t id;
    uint64_t dest;
    const int64_t *src_idx;
    const int64_t *dst_idx;
    const uint32_t *imms; /* per write: write i carries imms[i]; NULL: each carries imm */
    uint64_t n;
    uint64_t src_addr;
    uint64_t src_stride;
    void *desc;
    uint64_t dst_addr;
    uint64_t dst_stride;
    uint64_t key;
    uint64_t len;
    uint64_t imm;
    uint64_t flags;
    int64_t deadline_ns;
    /* Owned by the worker after fabp_submit. */
    uint64_t posted;
    uint64_t outstanding;
    int32_t err;
    int32_t reported;
    /* With FABP_OP_TIMED, CLOCK_MONOTONIC (time.monotonic_ns) of the op's phases:
     * submitted, first write handed to the provider, last write posted, first reported
     * (done or failed); 0: not yet. */
    int64_t t_submit_ns;
    int64_t t_first_post_ns;
    int64_t t_last_post_ns;
    int64_t t_done_ns;
};

/* An op finished (err == 0), failed (err < 0, a negative fi errno) or was retired: retired
 * means the provider holds no context of it any more, so its memory may be freed. */
struct fabp_event {
    uint64_t id;
    int32_t err;
    int32_t retired;
    int64_t t_submit_ns; /* the op's phase times (struct fabp_op) when it was reported */
    int64_t t_first_post_ns;
    int64_t t_last_post_ns;
    int64_t t_done_ns;
};

/* Remote CQ data received: count completions carried the value imm. */
struct fabp_imm {
    uint64_t imm;
    uint64_t count;
    int64_t first_ns; /* when the first and the last were reaped (fabp_set_stamps), else 0 */
    int64_t last_ns;
};

struct fabp_stats {
    uint64_t writes_posted;
    uint64_t writes_completed;
    uint64_t eagain;
    uint64_t imms_received;
    uint64_t foreign_errors;
    int32_t last_foreign_err;
    uint64_t bytes_written; /* payload of writes completed without error */
    uint64_t sleeps; /* times the worker's thread went to sleep (a nap, or on its CQ's fd) */
    uint64_t posted_on_submit; /* writes the submitting thread posted itself (fabp_submit) */
};

struct fabp_worker;

/* max_inflight: slots (writes in flight) in all; dest_cap: the most one destination may hold
 * (0: max_inflight), so that a peer that stopped reading leaves slots to the others. */
struct fabp_worker *fabp_worker_new(struct fid_ep *ep, struct fid_cq *cq, uint32_t max_inflight,
                                    uint32_t dest_cap);
void fabp_worker_free(struct fabp_worker *w);
/* Sleep on the CQ's wait fd when idle (the CQ must have been opened with FI_WAIT_FD);
 * 0, or a negative errno. */
int fabp_worker_wait_fd(struct fabp_worker *w, struct fid_fabric *fabric);
void fabp_submit(struct fabp_worker *w, struct fabp_op *op);
/* Fail every accepted op to `dest` that has not failed yet, with `err`: it posts nothing more,
 * is reported by the next loop step and retires when its writes in flight return. */
void fabp_fail_dest(struct fabp_worker *w, uint64_t dest, int32_t err);
void fabp_interrupt(struct fabp_worker *w);
void fabp_set_timing(struct fabp_worker *w, int64_t spin_ns, int64_t idle_sleep_ns,
                     int64_t linger_ns, int64_t quiet_ns);
/* The longest an idle worker sleeps on its CQ's fd with no op queued (default 100 ms). */
void fabp_set_fd_sleep(struct fabp_worker *w, int64_t fd_sleep_ns);
/* How soon the caller knows writes will land. FABP_DUE_SOON: an idle worker that naps (no CQ
 * fd) naps idle_sleep_ns at most; FABP_DUE_NOW: that, and a worker that sleeps on its CQ's fd
 * polls the CQ instead for 2 ms after its last activity; 0: naps grow with idleness up to a
 * millisecond again and fd workers sleep. */
#define FABP_DUE_SOON 1
#define FABP_DUE_NOW 2
void fabp_set_eager(struct fabp_worker *w, int level);
/* How long the worker would nap (no CQ fd) after idle_ns without activity: what the two
 * settings above decide, for tests and for reading. */
int64_t fabp_idle_nap_ns(struct fabp_worker *w, int64_t idle_ns);
/* Whether the worker, idle for idle_ns since its last activity, would poll its CQ rather than
 * sleep on its fd (FABP_DUE_NOW); for tests and for reading. */
int fabp_idle_polls(struct fabp_worker *w, int64_t idle_ns);
/* Whether reaped immediates are stamped (struct fabp_imm's first_ns and last_ns). */
void fabp_set_stamps(struct fabp_worker *w, int on);
void fabp_get_stats(struct fabp_worker *w, struct fabp_stats *out);
uint32_t fabp_inflight(struct fabp_worker *w);
int fabp_run_waited(struct fabp_worker *w, struct fabp_op *op, int submit, int64_t slice_ns);
int fabp_run_prepared(struct fabp_worker *w, struct fabp_op *op, int64_t timeout_ns,
                      int peer_fd);
int fabp_waiters(struct fabp_worker *w);
void fabp_close_waits(struct fabp_worker *w);
int fabp_progress(struct fabp_worker *w, int64_t budget_ns,
                  struct fabp_event *ev, int max_ev, int *n_ev,
                  struct fabp_imm *imm, int max_imm, int *n_imm);

/* Control-path helpers for what cffi cannot do from Python. */
uint32_t fabp_api_version(void);
int fabp_set_prov_name(struct fi_info *hints, const char *name);
int fabp_set_domain_name(struct fi_info *hints, const char *name);
int fabp_mr_reg_iface(struct fid_domain *domain, void *buf, size_t len, uint64_t access,
                      uint64_t requested_key, int iface, int device, struct fid_mr **mr);
