/*
 * echo_native ring: shared memory (a memfd, or POSIX shm as the fallback), the
 * byte layout of a ring segment, and the ticket/sequence protocol that hands
 * batch slots from producers (workers) to the consumer without locks.
 *
 * Protocol (one 32-bit sequence word per slot, ticket t lives in slot t % n):
 *   seq == 2t      slot is free for ticket t       (producer may fill it)
 *   seq == 2t + 1  slot holds ticket t             (consumer may read it)
 * A producer claims tickets with an atomic fetch-add, waits for 2t, fills the
 * slot and stores 2t + 1 with release ordering; the consumer waits for 2t + 1
 * with acquire ordering, reads in place, and frees the slot for ticket t + n by
 * storing 2(t + n).  Ordering is by ticket, so the output order is fixed
 * whatever the timing.  Words wrap modulo 2^32, which is harmless: waits
 * compare for equality and never more than n tickets are in flight.
 *
 * Segment layout.  This header is the single definition: the Python side
 * (echo_native/ring.py) reads every offset from the compiled module, so a C
 * program that includes only this file sees the same bytes.
 *
 *   [0, EN_RING_HEADER_BYTES)  en_ring_header, zero-padded to a page
 *   then nslots slots of en_ring_layout.slot_bytes each (page multiples):
 *     en_ring_slot (sequence word, metadata, failure records)
 *     a sample's record: the columns of EN_RING_COLUMNS below, each at its
 *     en_ring_layout offset, with the rows of its kind (EN_RING_ROW_KINDS: [B]
 *     for a sample column, [B][M] for an object column, M = max_objects,
 *     [B][M][K] for a keypoint column, K = max_keypoints, ...)
 *     then (page-aligned) pixels u8[B][S]
 *
 * All fields are native-endian: a segment never leaves the machine.
 * Pure C, no Python.h.
 */
#ifndef EN_RING_H
#define EN_RING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
#define _Static_assert static_assert /* C++ spells C11's keywords this way */
#define EN_RING_ALIGNAS(n) alignas(n)
extern "C" {
#else
#define EN_RING_ALIGNAS(n) _Alignas(n)
#endif

#define EN_RING_MAGIC UINT64_C(0x31474E4952484345) /* "ECHRING1" as little-endian bytes */
/* Bumped whenever a byte moves, so that a process built from other sources
 * refuses a segment instead of misreading it. */
#define EN_RING_VERSION 7u
#define EN_RING_PAGE 4096u
#define EN_RING_HEADER_BYTES EN_RING_PAGE
/* Claim words in the header; worker indexes run 0 .. EN_RING_MAX_WORKERS-1. */
#define EN_RING_MAX_WORKERS 64u
/* Failure-record area of a slot: one PATH_MAX path plus its message fits,
 * and a few dozen ordinary records. */
#define EN_RING_REPORT_BYTES 8192u
/* Claim word value while a worker is between taking a ticket and recording
 * it (0 means "holds nothing", t + 1 means "holds ticket t"). */
#define EN_RING_CLAIM_PENDING UINT64_MAX
/* Object slots per sample at most (the count is a u16). */
#define EN_RING_MAX_OBJECTS 65535u
/* Keypoints per object: COCO-WholeBody has 133; a skeleton of thousands is no pose. */
#define EN_RING_MAX_KEYPOINTS 1024u

/* The row kinds of a sample's record.  A column (EN_RING_COLUMNS below) has one
 * row per sample, or rows of one of these kinds: `size` rows per row of its parent
 * kind, `size` a field of en_ring_record, at most `limit`, 0 where the record does
 * not carry the kind.  The one place a kind is defined: the record's sizes, the
 * header, the layout and the bindings iterate it.
 *
 *   X(KIND, PARENT, size, limit) */
#define EN_RING_ROW_KINDS(X)                                                        \
    X(OBJECT,   SAMPLE, max_objects,   EN_RING_MAX_OBJECTS)   /* detection targets */ \
    X(KEYPOINT, OBJECT, max_keypoints, EN_RING_MAX_KEYPOINTS) /* a pose's points */    \
    X(MASK,     OBJECT, mask_bytes,    UINT32_MAX)           /* a bit-packed mask */

enum {
    EN_RING_ROWS_SAMPLE = 0,
#define EN_RING_ROWS_ENUM(kind, parent, size, limit) EN_RING_ROWS_##kind,
    EN_RING_ROW_KINDS(EN_RING_ROWS_ENUM)
#undef EN_RING_ROWS_ENUM
    EN_RING_NROWS
};

/* A record's sizes: the rows per parent row of each kind of EN_RING_ROW_KINDS. */
typedef struct en_ring_record {
#define EN_RING_RECORD_FIELD(kind, parent, size, limit) uint32_t size;
    EN_RING_ROW_KINDS(EN_RING_RECORD_FIELD)
#undef EN_RING_RECORD_FIELD
} en_ring_record;

/* One kind of EN_RING_ROW_KINDS, for bindings: its name, its parent kind
 * (EN_RING_ROWS_*), its size's name and limit, and where en_ring_record keeps it. */
typedef struct en_ring_row_kind {
    const char *name;
    uint32_t parent;
    const char *size;
    uint32_t limit;
    size_t record_field;   /* offsetof(en_ring_record, <size>) */
} en_ring_row_kind;
/* The kinds after SAMPLE, in order; ends with a NULL name. */
extern const en_ring_row_kind en_ring_row_kinds[];

/* en_ring_slot.error */
enum { EN_RING_ERR_NONE = 0, EN_RING_ERR_WORKER = 1, EN_RING_ERR_DECODE = 2 };
/* per-sample status[] */
enum { EN_RING_OK = 0, EN_RING_REPLACED = 1, EN_RING_SKIPPED = 2 };
/* per-object obj_flags[] bits: a crowd region (COCO's iscrowd); a box its crop
 * dropped (RandomIoUCrop: its centre fell outside the crop). */
enum { EN_RING_OBJ_CROWD = 1, EN_RING_OBJ_DROPPED = 2 };
/* per-sample reason[] and en_ring_failure.reason */
enum { EN_RING_REASON_NONE = 0, EN_RING_REASON_DECODE = 1, EN_RING_REASON_READ = 2,
       EN_RING_REASON_LIMIT = 3 };

/* The first page of a segment. */
typedef struct en_ring_header {
    uint64_t magic;        /* stored last (release) by en_ring_init */
    uint32_t version;
    uint32_t owner_pid;    /* the consumer; workers exit when it is gone */
    uint32_t nslots;
    uint32_t batch;
    uint64_t sample_bytes; /* pixel bytes reserved per sample */
    uint64_t slot_bytes;
    uint32_t closed;       /* futex word: non-zero once the consumer closes */
    uint64_t next_ticket;  /* fetch-add counter */
    en_ring_record record; /* the sizes of a sample's record (EN_RING_ROW_KINDS) */
    /* claims[w]: what worker w holds (0, t + 1, or EN_RING_CLAIM_PENDING), so
     * the consumer can tell which tickets a dead worker lost.  On a cache line of
     * their own, however many row kinds the record has. */
    EN_RING_ALIGNAS(64) uint64_t claims[EN_RING_MAX_WORKERS];
    /* reading[w]: sample id + 1 that worker w is reading and decoding (0: none),
     * since reading_ms[w] (CLOCK_MONOTONIC, shared by every process of a boot),
     * so the consumer can fail a sample whose read has stalled and replace its
     * worker (a hung network mount cannot be interrupted from inside). */
    uint64_t reading[EN_RING_MAX_WORKERS];
    uint64_t reading_ms[EN_RING_MAX_WORKERS];
} en_ring_header;

_Static_assert(sizeof(en_ring_header) <= EN_RING_HEADER_BYTES,
               "the ring header must fit its page: lower EN_RING_MAX_WORKERS");
_Static_assert(sizeof(en_ring_header) ==
                   offsetof(en_ring_header, claims) + 3 * 8 * EN_RING_MAX_WORKERS,
               "unexpected padding in en_ring_header");
/* Futex words are 32-bit and 4-aligned; 64-bit atomics must be 8-aligned
 * (a split word is not atomic, and the page start is the only alignment a
 * mapping guarantees). */
_Static_assert(offsetof(en_ring_header, closed) % 4 == 0, "closed must be a futex word");
_Static_assert(offsetof(en_ring_header, next_ticket) % 8 == 0, "next_ticket must be 8-aligned");
_Static_assert(offsetof(en_ring_header, claims) % 8 == 0, "claims must be 8-aligned");
_Static_assert(offsetof(en_ring_header, claims) % 64 == 0, "claims start on their own cache line");

/* The start of every slot (slots start on page boundaries). */
typedef struct en_ring_slot {
    uint32_t seq;          /* futex word of the protocol above */
    uint32_t count;        /* samples in the batch */
    uint64_t ticket;
    uint32_t error;        /* EN_RING_ERR_* */
    uint32_t failures;     /* samples that failed, whether or not report[] names them */
    uint32_t report_len;   /* bytes of report[] in use */
    uint32_t fill_us;      /* microseconds the worker spent filling the slot */
    uint32_t warned;       /* samples decoded with harmless warnings only (header junk,
                            * odd metadata): accepted, even in strict mode, and counted */
    uint32_t reserved0;
    uint64_t reserved[3];
    /* A sequence of en_ring_failure records (see below), in the order the
     * samples failed.  ERR_DECODE: the last record is the sample to raise
     * for.  ERR_WORKER: one record, sample_id EN_RING_NO_SAMPLE, empty path,
     * the worker's traceback as message. */
    uint8_t report[EN_RING_REPORT_BYTES];
} en_ring_slot;

_Static_assert(offsetof(en_ring_slot, seq) == 0, "seq opens the slot (page-aligned)");
_Static_assert(offsetof(en_ring_slot, ticket) % 8 == 0, "ticket must be 8-aligned");
_Static_assert(offsetof(en_ring_slot, report) == 64, "report starts on a cache line");
_Static_assert(sizeof(en_ring_slot) == 64 + EN_RING_REPORT_BYTES, "unexpected padding in en_ring_slot");
_Static_assert(sizeof(en_ring_slot) % 16 == 0, "the per-sample arrays that follow need 16-alignment");

/* One failure record in en_ring_slot.report: this header, then path_len
 * bytes of path (raw file-system bytes, any value allowed), then message_len
 * bytes of UTF-8 message, then zero padding to EN_RING_FAILURE_ALIGN, so
 * that the next header can be read in place.  Lengths, not separators, so no
 * byte of a path or message can end or forge a record. */
typedef struct en_ring_failure {
    uint64_t sample_id;    /* EN_RING_NO_SAMPLE when the failure is not a sample's */
    uint32_t path_len;
    uint32_t message_len;
    uint8_t reason;        /* EN_RING_REASON_* */
    uint8_t flags;         /* EN_RING_FAILURE_CLIPPED | EN_RING_FAILURE_DROPPED */
    uint8_t reserved[6];
} en_ring_failure;

#define EN_RING_FAILURE_ALIGN 8u
#define EN_RING_NO_SAMPLE UINT64_MAX
/* The path or message was shortened to fit (the cut carries a "[...]" mark). */
#define EN_RING_FAILURE_CLIPPED 1u
/* The sample's slot holds nothing for it: under on_error="replace" every stand-in
 * failed too, so the batch is one sample shorter. */
#define EN_RING_FAILURE_DROPPED 2u

_Static_assert(sizeof(en_ring_failure) == 24, "unexpected padding in en_ring_failure");
_Static_assert(sizeof(en_ring_failure) % EN_RING_FAILURE_ALIGN == 0, "records stay aligned");
_Static_assert(EN_RING_REPORT_BYTES % EN_RING_FAILURE_ALIGN == 0, "records stay aligned");

/* A sample's record in a slot: one column per field, each an array over the batch,
 * in this order after the slot's header words.  The one place the record is spelled
 * out: the layout, the binding's views and the consumer's batches all iterate it.
 *
 *   X(name, C type, NumPy dtype, alignment, rows, width)
 *
 * rows: SAMPLE (one row per sample of the batch) or a kind of EN_RING_ROW_KINDS
 * (OBJECT: max_objects rows per sample, KEYPOINT: max_keypoints rows per object, MASK:
 * mask_bytes rows per object, its mask bit-packed at the stored image's size); width:
 * elements of the type per row.  Alignment is the array's: boxes on 16 bytes, for SIMD loads of a whole box.  Pixels (page-aligned, sample_bytes a
 * sample) follow the columns. */
#define EN_RING_COLUMNS(X) \
    X(labels,       int64_t,  "i8", 8,  SAMPLE, 1) /* the sample's class */            \
    X(sample_ids,   int64_t,  "i8", 8,  SAMPLE, 1) /* its index in the source */       \
    X(status,       uint8_t,  "u1", 1,  SAMPLE, 1) /* OK or a failure's code */        \
    X(reason,       uint8_t,  "u1", 1,  SAMPLE, 1) /* EN_RING_REASON_* of a failure */  \
    X(flip,         uint8_t,  "u1", 1,  SAMPLE, 1) /* mirrored by the crop */          \
    X(boxes,        float,    "f4", 16, SAMPLE, 4) /* crop box (top, left, h, w) */    \
    X(shapes,       int32_t,  "i4", 8,  SAMPLE, 2) /* pixels' (height, width) */       \
    X(source_hw,    int32_t,  "i4", 8,  SAMPLE, 2) /* the decoded image's size */      \
    X(canvas_scale, float,    "f4", 8,  SAMPLE, 2) /* source px per canvas px */       \
    X(obj_count,    uint16_t, "u2", 2,  SAMPLE, 1) /* objects of the sample */         \
    X(obj_boxes,    float,    "f4", 16, OBJECT, 4) /* xyxy in source pixels */         \
    X(obj_labels,   int64_t,  "i8", 8,  OBJECT, 1)                                     \
    X(obj_flags,    uint8_t,  "u1", 1,  OBJECT, 1) /* EN_RING_OBJ_* */           \
    X(obj_keypoints, float,   "f4", 4,  KEYPOINT, 3) /* x, y, visibility, source px */ \
    X(obj_masks,    uint8_t,  "u1", 1,  MASK, 1) /* np.packbits rows of the image */

/* Where the per-sample arrays of a slot lie, for one geometry.  Offsets are
 * from the start of a slot. */
typedef struct en_ring_layout {
    uint32_t nslots;
    uint32_t batch;
    uint64_t sample_bytes;
    en_ring_record record;
#define EN_RING_OFFSET_FIELD(name, type, dtype, align, rows, width) size_t name;
    EN_RING_COLUMNS(EN_RING_OFFSET_FIELD)
#undef EN_RING_OFFSET_FIELD
    size_t pixels;         /* page-aligned */
    size_t slot_bytes;     /* a page multiple */
    size_t total_bytes;    /* header page + every slot */
} en_ring_layout;

/* One column of EN_RING_COLUMNS, for bindings: its name, NumPy dtype, rows
 * (EN_RING_ROWS_*), width, and where en_ring_layout keeps its offset. */
typedef struct en_ring_column {
    const char *name;
    const char *dtype;
    uint32_t rows;
    uint32_t width;
    size_t layout_field;   /* offsetof(en_ring_layout, <name>) */
} en_ring_column;
extern const en_ring_column en_ring_columns[];   /* ends with a NULL name */

/* Fill *out for a geometry; 0 on success, -1 (out untouched) for one that
 * cannot exist: no slots, an empty batch, a record size over its kind's limit,
 * or sizes that overflow. */
int en_ring_compute_layout(uint32_t nslots, uint32_t batch, uint64_t sample_bytes,
                           const en_ring_record *record, en_ring_layout *out);

/* Write the header of a new, zero-filled segment of at least
 * layout->total_bytes and free slot t % nslots for ticket t, for the nslots
 * tickets from first_ticket.  -1 if the segment is too small. */
int en_ring_init(void *mem, size_t size, const en_ring_layout *layout, uint64_t first_ticket,
                 uint32_t owner_pid);

enum { EN_RING_CHECK_OK = 0, EN_RING_NOT_A_RING = 1, EN_RING_BAD_VERSION = 2,
       EN_RING_BAD_GEOMETRY = 3 };
/* Validate a mapped segment made by en_ring_init and recompute its layout. */
int en_ring_check(const void *mem, size_t size, en_ring_layout *out);

/* The claim word of a worker, or NULL when worker >= EN_RING_MAX_WORKERS
 * (it would address the slots that follow the header). */
uint64_t *en_ring_claim(en_ring_header *header, uint64_t worker);

/* The reading word of a worker (reading_ms is the word EN_RING_MAX_WORKERS
 * further on), or NULL when worker >= EN_RING_MAX_WORKERS. */
uint64_t *en_ring_reading(en_ring_header *header, uint64_t worker);

static inline en_ring_slot *en_ring_slot_of(void *mem, const en_ring_layout *layout,
                                            uint64_t ticket) {
    return (en_ring_slot *)((uint8_t *)mem + EN_RING_HEADER_BYTES +
                            (size_t)(ticket % layout->nslots) * layout->slot_bytes);
}
static inline uint32_t en_ring_seq_free(uint64_t ticket) { return (uint32_t)(2 * ticket); }
static inline uint32_t en_ring_seq_filled(uint64_t ticket) { return (uint32_t)(2 * ticket + 1); }

/* Name, offset and size of the meaningful fields of the structs above (no
 * padding), terminated by a NULL name: how bindings learn the layout
 * without restating it. */
typedef struct en_ring_field {
    const char *name;
    size_t offset;
    size_t size;   /* whole field */
    size_t width;  /* one element (size / width elements) */
} en_ring_field;
extern const en_ring_field en_ring_header_fields[];
extern const en_ring_field en_ring_slot_fields[];
extern const en_ring_field en_ring_failure_fields[];

/* ---- the memory behind a ring --------------------------------------------------------
 * A ring lives in one of two kinds of shared memory:
 *
 *   memfd  an anonymous memory file (memfd_create, close-on-exec): no name in any file
 *          system, so nothing to sweep or to leak, and not bounded by the size of the
 *          /dev/shm mount.  Other processes receive it as a file descriptor; its memory
 *          is freed when the last descriptor and the last mapping are gone, whatever
 *          way its processes end.  Its segment name, "/memfd:<label>", is what
 *          /proc/<pid>/fd and /proc/<pid>/maps show for it; <label> is
 *          "<prefix>-<creator pid>-<anything>", so that en_shm_attach can find it
 *          among the creator's descriptors.
 *   shm    a POSIX shared-memory object ("/<name>", a file in /dev/shm): the fallback
 *          where memfd_create is unavailable.  Its name outlives a killed creator.
 *
 * Either way every page is allocated when the segment is created (fallocate), so a
 * segment that does not fit fails there, with ENOMEM or ENOSPC, and never later with
 * SIGBUS in a process touching a page the file system cannot provide.
 *
 * These functions return 0, or -1 with errno set and a message in err. */
#define EN_RING_MEMFD_PREFIX "/memfd:"

/* A new memfd of size bytes, every page allocated, its size sealed, mapped at *addr;
 * *fd receives its descriptor (close-on-exec: pass it to a child explicitly).
 * errno ENOSYS (or EPERM under a seccomp filter): no memfd_create here. */
int en_memfd_create(const char *label, size_t size, int *fd, void **addr, char *err,
                    size_t errlen);
/* Map the whole of the memory file open as fd (a memfd or a shared-memory object);
 * *size receives its length.  fd stays open: the caller closes it. */
int en_fd_attach(int fd, void **addr, size_t *size, char *err, size_t errlen);
/* A new descriptor of the memfd ring named "/memfd:<label>", found among its creator's
 * open descriptors (/proc/<pid>/fd): only while the creator holds it, and only for
 * processes allowed to look there (its user).  ENOENT when it holds none. */
int en_memfd_open(const char *name, char *err, size_t errlen);

/* Create a new shared-memory object (fails if the name exists), sized, every page
 * allocated (ENOSPC when the /dev/shm mount is too small), zero-filled. */
int en_shm_create(const char *name, size_t size, void **addr, char *err, size_t errlen);
/* Map an existing segment by name, "/<name>" or a memfd's "/memfd:<label>"; *size
 * receives its length. */
int en_shm_attach(const char *name, void **addr, size_t *size, char *err, size_t errlen);
int en_shm_detach(void *addr, size_t size);
/* 0 on success or when already gone; -1 with errno otherwise. */
int en_shm_unlink(const char *name);

uint64_t en_ticket_take(uint64_t *counter);
uint64_t en_load64(const uint64_t *word);
void en_store64(uint64_t *word, uint64_t value);
uint32_t en_seq_load(const uint32_t *word);
/* Release-store and wake every waiter on the word (other processes included). */
void en_seq_publish(uint32_t *word, uint32_t value);

/* Wake every waiter on the word without changing it (used when closing). */
void en_wake(uint32_t *word);

typedef enum en_wait_status {
    EN_WAIT_OK = 0,
    EN_WAIT_TIMEOUT = 1,
    EN_WAIT_CLOSED = 2,
} en_wait_status;

/* Wait until *word == expect (acquire), a bounded spin and then futex sleep.
 * Gives up after timeout_s, or when *closed becomes non-zero (closed may be
 * NULL).  Never spins for longer than a few microseconds. */
int en_seq_wait(const uint32_t *word, uint32_t expect, const uint32_t *closed, double timeout_s);

#ifdef __cplusplus
}
#endif
#endif
