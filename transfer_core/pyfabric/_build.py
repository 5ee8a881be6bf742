"""cffi out-of-line API-mode builder of `transfer_core.pyfabric._pyfabric` (S5).

libfabric's data path (fi_writedata, fi_cq_read, fi_mr_reg, ...) is static inline in the
headers, so only API mode, which compiles real C, can reach it. The libfabric structs are
declared partially (`...;`): the compiler fills in their layout. The C shim (shim.h and the
`_SHIM_SOURCES`, one translation unit) adds the batched write/progress loop. Run by setuptools via
setup.py's `cffi_modules`, or directly: `python transfer_core/pyfabric/_build.py` builds in place.
"""

from __future__ import annotations

from pathlib import Path

import cffi

_HERE = Path(__file__).resolve().parent

# Partial declarations of the libfabric 1.x API the Python objects need. Field lists name only
# what is read or written; API mode checks them against the real headers at compile time.
_LIBFABRIC_CDEF = """
typedef uint64_t fi_addr_t;
typedef struct fid *fid_t;
struct fid { ...; };
struct fid_fabric { struct fid fid; ...; };
struct fid_domain { struct fid fid; ...; };
struct fid_ep { struct fid fid; ...; };
struct fid_av { struct fid fid; ...; };
struct fid_cq { struct fid fid; ...; };
struct fid_mr { struct fid fid; ...; };
struct fi_context2 { ...; };

enum fi_ep_type { FI_EP_UNSPEC, FI_EP_MSG, FI_EP_DGRAM, FI_EP_RDM, ... };
enum fi_av_type { FI_AV_UNSPEC, FI_AV_MAP, FI_AV_TABLE, ... };
enum fi_progress { FI_PROGRESS_UNSPEC, FI_PROGRESS_AUTO, FI_PROGRESS_MANUAL, ... };
enum fi_threading { FI_THREAD_UNSPEC, FI_THREAD_SAFE, FI_THREAD_DOMAIN, ... };
enum fi_cq_format { FI_CQ_FORMAT_UNSPEC, FI_CQ_FORMAT_DATA, ... };
enum fi_wait_obj { FI_WAIT_NONE, FI_WAIT_UNSPEC, FI_WAIT_FD, ... };
enum fi_hmem_iface { FI_HMEM_SYSTEM, FI_HMEM_CUDA, ... };

struct fi_tx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t inject_size;
                    size_t size; ...; };
struct fi_rx_attr { uint64_t caps; uint64_t mode; uint64_t op_flags; size_t size; ...; };
struct fi_ep_attr { enum fi_ep_type type; size_t max_msg_size; ...; };
struct fi_domain_attr { char *name; enum fi_threading threading;
                        enum fi_progress control_progress; enum fi_progress data_progress;
                        enum fi_av_type av_type; int mr_mode; size_t mr_key_size;
                        size_t cq_data_size; size_t mr_cnt; ...; };
struct fi_fabric_attr { char *name; char *prov_name; uint32_t prov_version; ...; };
struct fi_info { struct fi_info *next; uint64_t caps; uint64_t mode; uint32_t addr_format;
                 size_t src_addrlen; void *src_addr; struct fi_tx_attr *tx_attr;
                 struct fi_rx_attr *rx_attr; struct fi_ep_attr *ep_attr;
                 struct fi_domain_attr *domain_attr; struct fi_fabric_attr *fabric_attr; ...; };
struct fi_cq_attr { size_t size; uint64_t flags; enum fi_cq_format format;
                    enum fi_wait_obj wait_obj; ...; };
struct fi_av_attr { enum fi_av_type type; size_t count; ...; };
struct fi_cq_data_entry { void *op_context; uint64_t flags; size_t len; void *buf;
                          uint64_t data; };
struct fi_cq_err_entry { void *op_context; uint64_t flags; size_t len; void *buf; uint64_t data;
                         int err; int prov_errno; ...; };

#define FI_MSG ...
#define FI_RMA ...
#define FI_READ ...
#define FI_WRITE ...
#define FI_REMOTE_READ ...
#define FI_REMOTE_WRITE ...
#define FI_REMOTE_CQ_DATA ...
#define FI_HMEM ...
#define FI_SOURCE ...
#define FI_CONTEXT ...
#define FI_CONTEXT2 ...
#define FI_TRANSMIT ...
#define FI_RECV ...
#define FI_DELIVERY_COMPLETE ...
#define FI_TRANSMIT_COMPLETE ...
#define FI_MR_LOCAL ...
#define FI_MR_RAW ...
#define FI_MR_VIRT_ADDR ...
#define FI_MR_ALLOCATED ...
#define FI_MR_PROV_KEY ...
#define FI_MR_ENDPOINT ...
#define FI_MR_HMEM ...
#define FI_ADDR_UNSPEC ...
#define FI_EAGAIN ...
#define FI_EAVAIL ...
#define FI_ENODATA ...
#define FI_ENOKEY ...
#define FI_ETIMEDOUT ...
#define FI_ECANCELED ...
#define FI_ENOTCONN ...
#define FI_ECONNREFUSED ...
#define FI_ECONNRESET ...
#define FI_ECONNABORTED ...
#define FI_EHOSTUNREACH ...
#define FI_EACCES ...
#define FI_EIO ...

const char *fi_strerror(int errnum);
uint32_t fi_version(void);
struct fi_info *fi_allocinfo(void);
void fi_freeinfo(struct fi_info *info);
struct fi_info *fi_dupinfo(const struct fi_info *info);
int fi_getinfo(uint32_t version, const char *node, const char *service, uint64_t flags,
               const struct fi_info *hints, struct fi_info **info);
int fi_fabric(struct fi_fabric_attr *attr, struct fid_fabric **fabric, void *context);
int fi_domain(struct fid_fabric *fabric, struct fi_info *info, struct fid_domain **domain,
              void *context);
int fi_endpoint(struct fid_domain *domain, struct fi_info *info, struct fid_ep **ep,
                void *context);
int fi_cq_open(struct fid_domain *domain, struct fi_cq_attr *attr, struct fid_cq **cq,
               void *context);
int fi_av_open(struct fid_domain *domain, struct fi_av_attr *attr, struct fid_av **av,
               void *context);
int fi_ep_bind(struct fid_ep *ep, struct fid *bfid, uint64_t flags);
int fi_enable(struct fid_ep *ep);
int fi_close(struct fid *fid);
int fi_getname(fid_t fid, void *addr, size_t *addrlen);
int fi_av_insert(struct fid_av *av, const void *addr, size_t count, fi_addr_t *fi_addr,
                 uint64_t flags, void *context);
int fi_mr_reg(struct fid_domain *domain, const void *buf, size_t len, uint64_t access,
              uint64_t offset, uint64_t requested_key, uint64_t flags, struct fid_mr **mr,
              void *context);
void *fi_mr_desc(struct fid_mr *mr);
uint64_t fi_mr_key(struct fid_mr *mr);
int fi_mr_bind(struct fid_mr *mr, struct fid *bfid, uint64_t flags);
int fi_mr_enable(struct fid_mr *mr);
ssize_t fi_cq_read(struct fid_cq *cq, void *buf, size_t count);
ssize_t fi_cq_readerr(struct fid_cq *cq, struct fi_cq_err_entry *buf, uint64_t flags);
"""

_INCLUDES = """
#include <stdint.h>
#include <sys/uio.h>
#include <rdma/fabric.h>
#include <rdma/fi_cm.h>
#include <rdma/fi_domain.h>
#include <rdma/fi_endpoint.h>
#include <rdma/fi_eq.h>
#include <rdma/fi_errno.h>
#include <rdma/fi_rma.h>
"""


# Concatenated in this order into one translation unit: each file uses the statics of those
# before it (the worker, then posting and reaping, the loop, waited ops, control helpers).
_SHIM_SOURCES = (
    "shim.c.in",
    "shim_post.c.in",
    "shim_progress.c.in",
    "shim_wait.c.in",
    "shim_control.c.in",
)


def _read(name: str) -> str:
    return (_HERE / name).read_text()


ffibuilder = cffi.FFI()
ffibuilder.cdef(_LIBFABRIC_CDEF + _read("shim.h"))
ffibuilder.set_source(
    "transfer_core.pyfabric._pyfabric",
    _INCLUDES + _read("shim.h") + "".join(_read(name) for name in _SHIM_SOURCES),
    libraries=["fabric"],
    extra_compile_args=["-O2", "-std=gnu11", "-Wall", "-Wno-unused-function"],
)


if __name__ == "__main__":
    # In-place build: the module lands next to this file, as an editable install expects,
    # under the abi3 name: Python prefers a cpython-311 file over it, so two copies of the
    # module side by side would load the older one whenever that is the version-tagged one.
    built = Path(ffibuilder.compile(tmpdir=str(_HERE.parent.parent), verbose=False))
    built.replace(_HERE / "_pyfabric.abi3.so")
