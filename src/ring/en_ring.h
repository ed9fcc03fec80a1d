/*
 * echo_native ring: POSIX shared memory and the ticket/sequence protocol that
 * hands batch slots from producers (workers) to the consumer without locks.
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
 * Pure C, no Python.h.
 */
#ifndef EN_RING_H
#define EN_RING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Create a new segment (fails if the name exists), sized and zero-filled. */
int en_shm_create(const char *name, size_t size, void **addr, char *err, size_t errlen);
/* Map an existing segment; *size receives its length. */
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
