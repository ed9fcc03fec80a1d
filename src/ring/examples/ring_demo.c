/*
 * The ring without Python: proof that en_ring.h alone is enough to produce
 * into and consume from a ring segment (and to read its layout).
 *
 *   ring_demo                        create a ring, fork a producer, consume and
 *                                    check every ticket in order; exit 0 if all good
 *   ring_demo produce NAME TICKETS   attach to a ring made elsewhere (echo_native's
 *                                    Ring.create) and fill tickets 0..TICKETS-1
 *   ring_demo layout NSLOTS BATCH SAMPLE_BYTES SIZE...
 *                                    print the struct offsets and the layout as JSON
 *
 * What a ticket holds is a function of the ticket (see fill()), so the
 * consumer, here or in Python, can check every byte it reads.
 *
 * Build: cc -std=c11 -I src/ring src/ring/examples/ring_demo.c src/ring/en_ring.c -lrt
 */
#define _POSIX_C_SOURCE 200809L
#include "en_ring.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#define TIMEOUT_S 20.0

static uint8_t pixel(uint64_t ticket, uint32_t i, size_t k) {
    return (uint8_t)(ticket * 31u + i * 7u + k);
}

/* The path of ticket t's failure record: bytes no text format survives. */
static size_t bad_path(uint64_t t, char *out, size_t cap) {
    int n = snprintf(out, cap, "dir\t%" PRIu64 "\n\xff\xfe.jpg", t);
    return n < 0 ? 0 : (size_t)n;
}

static uint32_t put_failure(uint8_t *report, uint32_t at, uint64_t sample_id, uint8_t reason,
                            const char *path, uint32_t path_len, const char *message) {
    en_ring_failure f;
    memset(&f, 0, sizeof f);
    f.sample_id = sample_id;
    f.reason = reason;
    f.path_len = path_len;
    f.message_len = (uint32_t)strlen(message);
    uint32_t size = (uint32_t)sizeof f + f.path_len + f.message_len;
    uint32_t padded = (size + EN_RING_FAILURE_ALIGN - 1) / EN_RING_FAILURE_ALIGN * EN_RING_FAILURE_ALIGN;
    if (at + padded > EN_RING_REPORT_BYTES) return at; /* dropped whole; failures still counts it */
    memset(report + at, 0, padded);
    memcpy(report + at, &f, sizeof f);
    memcpy(report + at + sizeof f, path, f.path_len);
    memcpy(report + at + sizeof f + f.path_len, message, f.message_len);
    return at + padded;
}

/* Everything a producer writes into ticket t's slot. */
static void fill(en_ring_slot *s, const en_ring_layout *l, uint64_t t) {
    int64_t *labels = (int64_t *)((uint8_t *)s + l->labels);
    int64_t *ids = (int64_t *)((uint8_t *)s + l->sample_ids);
    uint8_t *status = (uint8_t *)s + l->status;
    uint8_t *reason = (uint8_t *)s + l->reason;
    uint8_t *pixels = (uint8_t *)s + l->pixels;
    for (uint32_t i = 0; i < l->batch; i++) {
        labels[i] = (int64_t)(t * 1000 + i);
        ids[i] = (int64_t)(t * l->batch + i);
        status[i] = EN_RING_OK;
        reason[i] = EN_RING_REASON_NONE;
        for (size_t k = 0; k < l->sample_bytes; k++) pixels[i * l->sample_bytes + k] = pixel(t, i, k);
    }
    char path[64], message[64];
    size_t n = bad_path(t, path, sizeof path);
    snprintf(message, sizeof message, "C failure for ticket %" PRIu64, t);
    s->count = l->batch;
    s->ticket = t;
    s->error = EN_RING_ERR_NONE;
    s->failures = 1;
    s->fill_us = 0;
    s->warned = 0;
    s->report_len = put_failure(s->report, 0, t * l->batch, EN_RING_REASON_DECODE, path,
                                (uint32_t)n, message);
}

static int produce(void *mem, const en_ring_layout *l, uint64_t tickets, uint32_t worker) {
    en_ring_header *h = mem;
    uint64_t *claim = en_ring_claim(h, worker);
    if (!claim) return 1;
    for (;;) {
        en_store64(claim, EN_RING_CLAIM_PENDING);
        uint64_t t = en_ticket_take(&h->next_ticket);
        en_store64(claim, t + 1);
        if (t >= tickets) break;
        en_ring_slot *s = en_ring_slot_of(mem, l, t);
        if (en_seq_wait(&s->seq, en_ring_seq_free(t), &h->closed, TIMEOUT_S) != EN_WAIT_OK) {
            fprintf(stderr, "producer: slot of ticket %" PRIu64 " never came free\n", t);
            return 1;
        }
        fill(s, l, t);
        en_seq_publish(&s->seq, en_ring_seq_filled(t));
    }
    en_store64(claim, 0);
    return 0;
}

/* 0 if ticket t's slot holds exactly what fill() writes. */
static int check(en_ring_slot *s, const en_ring_layout *l, uint64_t t) {
    const int64_t *labels = (const int64_t *)((uint8_t *)s + l->labels);
    const uint8_t *pixels = (uint8_t *)s + l->pixels;
    if (s->ticket != t || s->count != l->batch || s->error != EN_RING_ERR_NONE || s->failures != 1)
        return fprintf(stderr, "ticket %" PRIu64 ": bad slot metadata\n", t), 1;
    for (uint32_t i = 0; i < l->batch; i++) {
        if (labels[i] != (int64_t)(t * 1000 + i))
            return fprintf(stderr, "ticket %" PRIu64 ": label %u\n", t, i), 1;
        for (size_t k = 0; k < l->sample_bytes; k++)
            if (pixels[i * l->sample_bytes + k] != pixel(t, i, k))
                return fprintf(stderr, "ticket %" PRIu64 ": pixel %u/%zu\n", t, i, k), 1;
    }
    /* Records are aligned, so the header can be read in place. */
    const en_ring_failure *f = (const en_ring_failure *)s->report;
    char path[64];
    size_t n = bad_path(t, path, sizeof path);
    if (s->report_len < sizeof *f || f->sample_id != t * l->batch ||
        f->reason != EN_RING_REASON_DECODE || f->path_len != n ||
        memcmp(s->report + sizeof *f, path, n) != 0)
        return fprintf(stderr, "ticket %" PRIu64 ": bad failure record\n", t), 1;
    return 0;
}

static int demo(void) {
    enum { NSLOTS = 3, BATCH = 4, SAMPLE_BYTES = 100, TICKETS = 11 }; /* several laps */
    en_ring_layout l;
    const en_ring_record plain = {0};   /* pixels and per-sample columns only */
    if (en_ring_compute_layout(NSLOTS, BATCH, SAMPLE_BYTES, &plain, &l) != 0) return 1;
    char name[64], err[256];
    snprintf(name, sizeof name, "/echo_native_demo-%ld", (long)getpid());
    void *mem;
    if (en_shm_create(name, l.total_bytes, &mem, err, sizeof err) != 0)
        return fprintf(stderr, "%s\n", err), 1;
    en_shm_unlink(name); /* the mapping outlives the name; nothing is left behind on a crash */
    if (en_ring_init(mem, l.total_bytes, &l, 0, (uint32_t)getpid()) != 0) return 1;
    en_ring_header *h = mem;
    if (en_ring_claim(h, EN_RING_MAX_WORKERS) != NULL) /* past the last claim word */
        return fprintf(stderr, "worker index %u was not refused\n", EN_RING_MAX_WORKERS), 1;

    pid_t child = fork();
    if (child < 0) return perror("fork"), 1;
    if (child == 0) _exit(produce(mem, &l, TICKETS, 0));

    int bad = 0;
    for (uint64_t t = 0; t < TICKETS && !bad; t++) {
        en_ring_slot *s = en_ring_slot_of(mem, &l, t);
        if (en_seq_wait(&s->seq, en_ring_seq_filled(t), &h->closed, TIMEOUT_S) != EN_WAIT_OK) {
            fprintf(stderr, "consumer: ticket %" PRIu64 " never came\n", t);
            bad = 1;
            break;
        }
        bad = check(s, &l, t);
        en_seq_publish(&s->seq, en_ring_seq_free(t + NSLOTS));
    }
    /* Wake a producer still waiting (only if something went wrong). */
    __atomic_store_n(&h->closed, 1, __ATOMIC_RELEASE);
    for (uint32_t i = 0; i < NSLOTS; i++) en_wake(&en_ring_slot_of(mem, &l, i)->seq);
    int status;
    if (waitpid(child, &status, 0) != child || !WIFEXITED(status) || WEXITSTATUS(status) != 0)
        bad = 1;
    en_shm_detach(mem, l.total_bytes);
    if (!bad) printf("ok: %d tickets through %d slots\n", TICKETS, NSLOTS);
    return bad;
}

static int produce_into(const char *name, uint64_t tickets) {
    void *mem;
    size_t size;
    char err[256];
    en_ring_layout l;
    if (en_shm_attach(name, &mem, &size, err, sizeof err) != 0)
        return fprintf(stderr, "%s\n", err), 1;
    if (en_ring_check(mem, size, &l) != EN_RING_CHECK_OK)
        return fprintf(stderr, "%s is not a ring this program can read\n", name), 1;
    int rc = produce(mem, &l, tickets, EN_RING_MAX_WORKERS - 1);
    en_shm_detach(mem, size);
    return rc;
}

#define FIELD(out, type, f) fprintf(out, "\"%s\": %zu, ", #f, offsetof(type, f))

static int print_layout(uint32_t nslots, uint32_t batch, uint64_t sample_bytes,
                        const en_ring_record *record) {
    en_ring_layout l;
    int ok = en_ring_compute_layout(nslots, batch, sample_bytes, record, &l) == 0;
    printf("{\"header\": {");
    FIELD(stdout, en_ring_header, magic); FIELD(stdout, en_ring_header, version);
    FIELD(stdout, en_ring_header, owner_pid); FIELD(stdout, en_ring_header, nslots);
    FIELD(stdout, en_ring_header, batch); FIELD(stdout, en_ring_header, sample_bytes);
    FIELD(stdout, en_ring_header, slot_bytes); FIELD(stdout, en_ring_header, closed);
    FIELD(stdout, en_ring_header, next_ticket); FIELD(stdout, en_ring_header, record);
    FIELD(stdout, en_ring_header, claims);
    FIELD(stdout, en_ring_header, reading); FIELD(stdout, en_ring_header, reading_ms);
    printf("\"sizeof\": %zu}, \"slot\": {", sizeof(en_ring_header));
    FIELD(stdout, en_ring_slot, seq); FIELD(stdout, en_ring_slot, count);
    FIELD(stdout, en_ring_slot, ticket); FIELD(stdout, en_ring_slot, error);
    FIELD(stdout, en_ring_slot, failures); FIELD(stdout, en_ring_slot, report_len);
    FIELD(stdout, en_ring_slot, fill_us); FIELD(stdout, en_ring_slot, warned);
    FIELD(stdout, en_ring_slot, report);
    printf("\"sizeof\": %zu}, \"failure\": {", sizeof(en_ring_slot));
    FIELD(stdout, en_ring_failure, sample_id); FIELD(stdout, en_ring_failure, path_len);
    FIELD(stdout, en_ring_failure, message_len); FIELD(stdout, en_ring_failure, reason);
    FIELD(stdout, en_ring_failure, flags);
    printf("\"sizeof\": %zu}, \"max_workers\": %u, \"report_bytes\": %u, \"page\": %u, ",
           sizeof(en_ring_failure), EN_RING_MAX_WORKERS, EN_RING_REPORT_BYTES, EN_RING_PAGE);
    if (!ok) {
        printf("\"layout\": null}\n");
        return 0;
    }
    /* The record's columns through the table, as every binding reads them. */
    printf("\"layout\": {");
    for (const en_ring_column *c = en_ring_columns; c->name != NULL; c++)
        printf("\"%s\": %zu, ", c->name, *(const size_t *)((const char *)&l + c->layout_field));
    for (const en_ring_row_kind *k = en_ring_row_kinds; k->name != NULL; k++)
        printf("\"%s\": %u, ", k->size,
               *(const uint32_t *)((const char *)&l.record + k->record_field));
    printf("\"pixels\": %zu, \"slot_bytes\": %zu, \"total_bytes\": %zu}}\n", l.pixels,
           l.slot_bytes, l.total_bytes);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 1) return demo();
    if (argc == 4 && strcmp(argv[1], "produce") == 0)
        return produce_into(argv[2], strtoull(argv[3], NULL, 10));
    if (argc == 5 + EN_RING_NROWS - 1 && strcmp(argv[1], "layout") == 0) {
        /* layout NSLOTS BATCH SAMPLE_BYTES, then each record size in the table's order */
        en_ring_record record;
        for (int k = 0; en_ring_row_kinds[k].name != NULL; k++)
            *(uint32_t *)((char *)&record + en_ring_row_kinds[k].record_field) =
                (uint32_t)strtoul(argv[5 + k], NULL, 10);
        return print_layout((uint32_t)strtoul(argv[2], NULL, 10),
                            (uint32_t)strtoul(argv[3], NULL, 10), strtoull(argv[4], NULL, 10),
                            &record);
    }
    fprintf(stderr, "usage: %s | %s produce NAME TICKETS | "
            "%s layout NSLOTS BATCH SAMPLE_BYTES SIZE... (the record's, en_ring_row_kinds)\n",
            argv[0], argv[0], argv[0]);
    return 2;
}
